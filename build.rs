//! Compiles the xDS rule resource (proto/) with a pure-Rust protobuf parser, so building needs
//! no `protoc`. Its `google.protobuf.Struct` is envoy-types' own, so the generated messages
//! plug into the discovery messages that carry them.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO: &str = "proto/ratelimit/config/ratelimit/v3/rls_conf.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["proto"])?;
    prost_build::Config::new()
        .extern_path(
            ".google.protobuf.Struct",
            "::envoy_types::pb::google::protobuf::Struct",
        )
        .compile_fds(descriptors)?;
    Ok(())
}
