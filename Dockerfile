# syntax=docker/dockerfile:1
# turnstile: build with the pinned Rust image, run on the same Debian release (same glibc).
#   docker build -t turnstile .
#   docker run --rm -p 8080:8080 -p 8081:8081 turnstile serve --config /etc/turnstile

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
# The caches keep the registry and the build directory between builds; the binary is
# copied out of the cached target/ in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin turnstile \
    && cp target/release/turnstile /usr/local/bin/turnstile

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 turnstile \
    && useradd --system --uid 10001 --gid turnstile --no-create-home --shell /usr/sbin/nologin turnstile \
    && printf '#!/bin/sh\nexec /usr/local/bin/turnstile serve "$@"\n' > /bin/ratelimit \
    && chmod 755 /bin/ratelimit
# /bin/ratelimit is the reference's command (Envoy Gateway runs its rate-limit container with
# it), so the image can replace the reference's without changing the command.
COPY --from=build /usr/local/bin/turnstile /usr/local/bin/turnstile
# The sample rules, so the image runs on its own; mount your own over /etc/turnstile.
COPY config/ /etc/turnstile/
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
ENV TURNSTILE_CONFIG=/etc/turnstile
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/turnstile"]
CMD ["serve"]
