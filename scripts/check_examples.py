#!/usr/bin/env python3
"""Checks the example and deployment files without Docker, Kubernetes or Envoy.

  examples/envoy/envoy.yaml   parsed into a real envoy.config.bootstrap.v3.Bootstrap (the
                              typed configs too), checked against the protos' validation
                              rules, and every descriptor its route actions produce is
                              looked up in config/rules.yaml the way turnstile does
  docker-compose.yml          the Compose Specification's JSON schema, then services,
                              depends_on, mounts, build contexts, ports, images
  Dockerfile, .dockerignore   stages, pinned images, the build command, the runtime user,
                              ports, COPY sources present in the build context
  examples/istio/*.yaml       kinds and apiVersions, Kubernetes schemas, the EnvoyFilter
                              patches parsed as Envoy protos, the ConfigMap's rules, and the
                              references between the objects

Rule files are validated by the built binary (`turnstile check`) when one exists
(target/debug or target/release, or --turnstile / $TURNSTILE_BIN), else by this script.

  python3 -m venv /tmp/examples-venv
  /tmp/examples-venv/bin/pip install -r scripts/requirements-examples.txt
  /tmp/examples-venv/bin/python scripts/check_examples.py [-v] [--root DIR]

Exits 1 when any check fails; the last line reads `examples: N passed, M failed`.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.resources
import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

try:
    import yaml
    import jsonschema
    import kubernetes_validate
    from google.protobuf import descriptor_pool, json_format, message_factory
    from google.protobuf.descriptor import FieldDescriptor

    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from envoy.config.route.v3 import route_components_pb2
    from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2,
    )
    from validate import validate_pb2

    # Imported for their side effect: registering the types that typed_config Anys name,
    # so ParseDict can resolve their "@type".
    from envoy.extensions.filters.http.router.v3 import router_pb2
    from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

    REGISTERED_TYPES = (router_pb2, http_protocol_options_pb2)
except ImportError as error:  # pragma: no cover - the message is the point
    sys.exit(
        f"check_examples: missing dependency ({error}).\n"
        "Install them with: pip install -r scripts/requirements-examples.txt"
    )

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

COMPOSE_SERVICES = ["envoy", "redis", "turnstile-1", "turnstile-2", "upstream"]

# Values that stand in for the ones a request supplies at run time. A descriptor passes
# when at least one combination of them reaches a rule (a limit, or `unlimited`).
SAMPLE_REMOTE_ADDRESS = ["192.0.2.10"]
SAMPLE_MASKED_REMOTE_ADDRESS = ["192.0.2.0/24"]
SAMPLE_HEADERS = {
    ":path": ["/", "/login", "/api/v1/items", "/login?next=/"],
    ":authority": ["example.com"],
    "x-user-id": ["alice"],
    "x-plan": ["free", "internal"],
}
SAMPLE_DEFAULT = ["sample"]
ABSENT = object()  # a request_headers entry skipped because the header is missing

ISTIO_KINDS = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
}
ENVOYFILTER_APPLY_TO = {
    "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
    "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP",
    "LISTENER_FILTER",
}
ENVOYFILTER_OPERATIONS = {
    "MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE",
}
ENVOYFILTER_CONTEXTS = {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"}


# --------------------------------------------------------------------------------------
# Reporting


class Failed(Exception):
    """Ends a check with one message."""


@dataclass
class Ctx:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def note(self, message: str) -> None:
        self.notes.append(message)


class Report:
    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.passed = 0
        self.failed = 0

    def run(self, name: str, check: Callable[..., Any], *args: Any) -> Any:
        """Runs one check; returns its value (True when it returns None), or None on failure."""
        ctx = Ctx()
        value = None
        try:
            value = check(ctx, *args)
        except Failed as error:
            ctx.fail(str(error))
        except Exception as error:  # a bug in the checker, or input it did not expect
            where = traceback.extract_tb(error.__traceback__)[-1]
            ctx.fail(f"unexpected {type(error).__name__}: {error} (check_examples.py:{where.lineno})")
        if ctx.problems:
            self.failed += 1
            print(f"FAIL  {name}")
            for problem in ctx.problems:
                print(indent(problem))
            for note in ctx.notes if self.verbose else []:
                print(indent(note, "      . "))
            return None
        self.passed += 1
        print(f"ok    {name}")
        for note in ctx.notes if self.verbose else []:
            print(indent(note, "      . "))
        return True if value is None else value


def indent(text: str, first: str = "      - ") -> str:
    pad = " " * len(first)
    lines = str(text).splitlines() or [""]
    return "\n".join([first + lines[0]] + [pad + line for line in lines[1:]])


def rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def load_yaml_documents(path: Path) -> list[Any]:
    try:
        text = path.read_text()
    except OSError as error:
        raise Failed(f"cannot read {path}: {error}")
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise Failed(f"{path}: not valid YAML: {error}")


def proto_error(error: Exception) -> str:
    """json_format chains one message per nesting level; the last one says it all."""
    text = str(error)
    # Keep it readable: the innermost message names the full path already.
    text = re.sub(r"^(Failed to parse \w+ field: )+", "", text)
    text = re.sub(r"\n Available Fields\(except extensions\): .*", "", text, flags=re.S)
    return text.rstrip(".") + "."


# --------------------------------------------------------------------------------------
# Rules: the reference's format, read and matched the way turnstile does


UNITS = {"second", "minute", "hour", "day", "week", "month", "year"}
ALGORITHMS = {"fixed_window", "sliding_window", "token_bucket", "concurrency"}
SLIDING_WINDOW_MAX_LIMIT = 10_000
KNOWN_RULE_KEYS = {
    "domain", "key", "value", "descriptors", "rate_limit", "unit", "requests_per_unit",
    "unlimited", "shadow_mode", "quota_mode", "name", "replaces", "detailed_metric",
    "value_to_metric", "share_threshold", "metadata", "algorithm", "burst", "on_backend_error",
    "window", "shards",
}
FAILURE_POLICIES = {"error", "allow", "deny", "local"}


@dataclass
class Rule:
    full_key: str
    name: str | None
    unlimited: bool
    unit: str | None = None
    requests_per_unit: int = 0
    algorithm: str = "fixed_window"
    burst: int | None = None

    def describe(self) -> str:
        if self.unlimited:
            return f"{self.full_key} (unlimited)"
        text = f"{self.full_key} ({self.requests_per_unit}/{self.unit} {self.algorithm}"
        if self.algorithm == "token_bucket":
            text += f", burst {self.burst}"
        return text + ")"


@dataclass
class Node:
    rule: Rule | None
    children: "Level"


@dataclass
class Branches:
    exact: dict[str, Node] = field(default_factory=dict)
    wildcards: list[tuple[str, Node]] = field(default_factory=list)
    default: Node | None = None

    def find(self, value: str) -> Node | None:
        if value in self.exact:
            return self.exact[value]
        for pattern, node in self.wildcards:
            if wildcard_matches(pattern, value):
                return node
        return self.default


@dataclass
class Level:
    keys: dict[str, Branches] = field(default_factory=dict)


def wildcard_matches(pattern: str, value: str) -> bool:
    """Each `*` matches any run of characters; prefix and suffix must not overlap."""
    parts = pattern.split("*")
    prefix, middle, suffix = parts[0], parts[1:-1], parts[-1]
    if not value.startswith(prefix):
        return False
    rest = value[len(prefix):]
    if not rest.endswith(suffix):
        return False
    rest = rest[: len(rest) - len(suffix)]
    for segment in middle:
        at = rest.find(segment)
        if at < 0:
            return False
        rest = rest[at + len(segment):]
    return True


def lookup(root: Level, entries: list[tuple[str, str]]) -> Rule | None:
    """The reference's walk: exact value, then wildcards in file order, then the key-only
    default; no backtracking; a rule applies only where the last entry lands."""
    level = root
    for index, (key, value) in enumerate(entries):
        branches = level.keys.get(key)
        node = branches.find(value) if branches else None
        if node is None:
            return None
        if index == len(entries) - 1:
            return node.rule
        level = node.children
    return None


class RulesLoader:
    """Reads rule files into {domain: Level}, collecting the reference's validation errors."""

    def __init__(self) -> None:
        self.domains: dict[str, Level] = {}
        self.errors: list[str] = []

    def error(self, where: str, node: yaml.Node | None, message: str) -> None:
        if node is not None:
            mark = node.start_mark
            where = f"{where}:{mark.line + 1}:{mark.column + 1}"
        self.errors.append(f"{where}: {message}")

    def load_text(self, name: str, text: str) -> None:
        try:
            documents = list(yaml.compose_all(text))
        except yaml.YAMLError as error:
            self.errors.append(f"{name}: not valid YAML: {error}")
            return
        if not documents:
            documents = [None]
        for document in documents:
            self.document(name, document)

    def sorted_errors(self) -> list[str]:
        def position(error: str) -> tuple:
            match = re.match(r"(.*?):(\d+):(\d+): ", error)
            return (match.group(1), int(match.group(2)), int(match.group(3))) if match else (error, 0, 0)
        return sorted(self.errors, key=position)

    def load_path(self, path: Path) -> None:
        files = sorted(
            p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()
        ) if path.is_dir() else [path]
        for file in files:
            self.load_text(str(file), file.read_text())

    # Scalars as the reference reads them (YAML 1.1, everything a string where it wants one).
    @staticmethod
    def scalar(node: yaml.Node) -> str | None:
        if isinstance(node, yaml.ScalarNode):
            if node.tag == "tag:yaml.org,2002:null":
                return None
            return node.value
        return None

    def keys(self, name: str, node: yaml.MappingNode) -> dict[str, yaml.Node]:
        out: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or key_node.tag != "tag:yaml.org,2002:str":
                self.error(name, key_node, f"config error, key is not of type string: {key!r}")
                continue
            if key not in KNOWN_RULE_KEYS:
                self.error(name, key_node, f"config error, unknown key '{key}'")
            out[key] = value_node
        return out

    def document(self, name: str, node: yaml.Node | None) -> None:
        if node is None or (isinstance(node, yaml.ScalarNode) and self.scalar(node) is None):
            self.errors.append(f"{name}: config file cannot have empty domain")
            return
        if not isinstance(node, yaml.MappingNode):
            self.error(name, node, "config file is not a map with 'domain' and 'descriptors'")
            return
        fields = self.keys(name, node)
        domain_node = fields.get("domain")
        domain = self.scalar(domain_node) if domain_node is not None else None
        root = self.level(name, domain or "", fields.get("descriptors"))
        if "on_backend_error" in fields:
            policy = self.scalar(fields["on_backend_error"]) or ""
            if policy not in FAILURE_POLICIES:
                self.error(name, fields["on_backend_error"],
                           f"invalid on_backend_error '{policy}' (expected error, allow, deny or local)")
        if not domain:
            self.error(name, domain_node or node, "config file cannot have empty domain")
        elif domain in self.domains:
            self.error(name, domain_node, f"duplicate domain '{domain}' in config file")
        else:
            self.domains[domain] = root

    def level(self, name: str, parent: str, node: yaml.Node | None) -> Level:
        level = Level()
        if node is None or (isinstance(node, yaml.ScalarNode) and self.scalar(node) is None):
            return level
        if not isinstance(node, yaml.SequenceNode):
            self.error(name, node, "descriptors must be a list")
            return level
        seen: set[str] = set()
        for item in node.value:
            if not isinstance(item, yaml.MappingNode):
                self.error(name, item, "a descriptor must be a map")
                continue
            fields = self.keys(name, item)
            key = self.scalar(fields["key"]) if "key" in fields else None
            value = self.scalar(fields["value"]) if "value" in fields else None
            value = value or None
            if not key:
                self.error(name, item, "descriptor has empty key")
                key = ""
            composite = f"{key}_{value}" if value is not None else key
            full_key = f"{parent}.{composite}"
            if composite in seen:
                self.error(name, item, f"duplicate descriptor composite key '{full_key}'")
            seen.add(composite)
            rule = None
            if "rate_limit" in fields:
                rule = self.rule(name, full_key, fields["rate_limit"])
            for flag in ("shadow_mode", "quota_mode", "detailed_metric"):
                if flag in fields and fields[flag].tag != "tag:yaml.org,2002:bool":
                    self.error(name, fields[flag], f"{flag} must be true or false")
            children = self.level(name, full_key, fields.get("descriptors"))
            step = Node(rule, children)
            branches = level.keys.setdefault(key, Branches())
            if value is None:
                branches.default = step
            elif "*" in value:
                branches.wildcards.append((value, step))
            else:
                branches.exact[value] = step
        return level

    def integer(self, name: str, node: yaml.Node, what: str) -> int | None:
        if node.tag != "tag:yaml.org,2002:int":
            self.error(name, node, f"{what} must be an unsigned integer")
            return None
        try:
            number = int(node.value.replace("_", ""), 0)
        except ValueError:
            self.error(name, node, f"{what} must be an unsigned integer")
            return None
        if not 0 <= number <= 2**32 - 1:
            self.error(name, node, f"{what} must be an unsigned 32-bit integer")
            return None
        return number

    def replaces(self, name: str, rule_name: str | None, fields: dict[str, yaml.Node]) -> None:
        replaces = fields.get("replaces")
        if not isinstance(replaces, yaml.SequenceNode):
            return
        for entry in replaces.value:
            entry_fields = self.keys(name, entry) if isinstance(entry, yaml.MappingNode) else {}
            target = self.scalar(entry_fields["name"]) if "name" in entry_fields else None
            if not target:
                self.error(name, entry, "should not have an empty replaces entry")
            elif target == rule_name:
                self.error(name, entry, "replaces should not contain name of same descriptor")

    def rule(self, name: str, full_key: str, node: yaml.Node) -> Rule | None:
        # A list is several limits on one descriptor; the first names the rule.
        if isinstance(node, yaml.SequenceNode) and node.value:
            for other in node.value[1:]:
                self.rule(name, full_key, other)
            node = node.value[0]
        if not isinstance(node, yaml.MappingNode):
            self.error(name, node, "rate_limit must be a map or a list of maps")
            return None
        fields = self.keys(name, node)
        rule_name = self.scalar(fields["name"]) if "name" in fields else None
        unlimited = "unlimited" in fields and fields["unlimited"].value in (
            "true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON", "y", "Y")
        unit = self.scalar(fields["unit"]) if "unit" in fields else None
        algorithm = self.scalar(fields["algorithm"]) if "algorithm" in fields else None
        if unlimited:
            self.replaces(name, rule_name, fields)
            if unit is not None and unit.lower() in UNITS:
                self.error(name, fields["unit"], "should not specify rate limit unit when unlimited")
            if "algorithm" in fields:
                self.error(name, fields["algorithm"], "should not specify algorithm when unlimited")
            if "burst" in fields:
                self.error(name, fields["burst"], "should not specify burst when unlimited")
            return Rule(full_key, rule_name, unlimited=True)
        if (unit is not None or "window" not in fields) and (unit is None or unit.lower() not in UNITS):
            self.error(name, fields.get("unit", node), f"invalid rate limit unit '{unit or ''}'")
        if algorithm is not None and algorithm not in ALGORITHMS:
            self.error(
                name, fields["algorithm"],
                f"invalid algorithm '{algorithm}' (expected fixed_window, sliding_window, "
                "token_bucket or concurrency)",
            )
        algorithm = algorithm or "fixed_window"
        rpu = 0
        if "requests_per_unit" in fields:
            rpu = self.integer(name, fields["requests_per_unit"], "requests_per_unit") or 0
            if algorithm == "sliding_window" and rpu > SLIDING_WINDOW_MAX_LIMIT:
                self.error(
                    name, fields["requests_per_unit"],
                    f"sliding_window keeps one entry per admitted request, so requests_per_unit "
                    f"must be at most {SLIDING_WINDOW_MAX_LIMIT} (found {rpu}); "
                    "use token_bucket for larger limits",
                )
        burst = rpu
        if "burst" in fields:
            given = self.integer(name, fields["burst"], "burst")
            if algorithm != "token_bucket":
                self.error(name, fields["burst"], "burst can only be used with algorithm token_bucket")
            elif given == 0:
                self.error(name, fields["burst"], "burst must be at least 1")
            burst = given if given is not None else rpu
        self.replaces(name, rule_name, fields)
        return Rule(full_key, rule_name, False, (unit or "").lower(), rpu, algorithm, burst)


def find_turnstile(root: Path, explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    candidates = [root / "target" / "debug" / "turnstile", root / "target" / "release" / "turnstile"]
    present = [c for c in candidates if c.is_file() and os.access(c, os.X_OK)]
    return max(present, key=lambda c: c.stat().st_mtime) if present else None


class RulesChecker:
    """Validates rule files with the binary when there is one, and always loads them in
    Python too, for the descriptor lookups."""

    def __init__(self, binary: Path | None):
        self.binary = binary

    def binary_check(self, ctx: Ctx, path: Path, label: str) -> bool:
        env = {k: v for k, v in os.environ.items() if k != "TURNSTILE_CONFIG"}
        try:
            done = subprocess.run(
                [str(self.binary), "check", "--config", str(path)],
                capture_output=True, text=True, timeout=60, env=env,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            ctx.fail(f"could not run {self.binary} check: {error}")
            return False
        output = (done.stdout + done.stderr).strip().replace(str(path), label)
        if done.returncode != 0:
            ctx.fail(f"`turnstile check` rejects {label}:\n{output}")
            return False
        ctx.note(f"turnstile check: {output.splitlines()[-1] if output else 'OK'}")
        return True

    def check(self, ctx: Ctx, path: Path, label: str) -> dict[str, Level] | None:
        loader = RulesLoader()
        loader.load_path(path)
        if self.binary is not None:
            if not self.binary_check(ctx, path, label):
                return None
            if loader.errors:
                ctx.fail(
                    "turnstile accepts these rules but check_examples.py's loader does not "
                    "(the checker is out of date):\n" + "\n".join(loader.sorted_errors())
                )
                return None
        else:
            ctx.note("validated in Python (no turnstile binary; build one to use `turnstile check`)")
            if loader.errors:
                ctx.fail(f"invalid rules in {label}:\n" + "\n".join(e.replace(str(path), label) for e in loader.sorted_errors()))
                return None
        ctx.note(f"domains: {', '.join(sorted(loader.domains))}")
        return loader.domains

    def check_text(self, ctx: Ctx, text: str, filename: str, label: str) -> dict[str, Level] | None:
        with tempfile.TemporaryDirectory(prefix="check-examples-") as tmp:
            path = Path(tmp) / filename
            path.write_text(text)
            return self.check(ctx, path, label)


# --------------------------------------------------------------------------------------
# Protos: parsing with typed Any configs, and the protoc-gen-validate rules Envoy enforces


def register_types(data: Any) -> None:
    """Imports the generated modules of every package that an "@type" in `data` names, so
    typed configs beyond the ones imported above (local_ratelimit, ...) resolve too."""
    if isinstance(data, dict):
        type_url = data.get("@type")
        if isinstance(type_url, str) and "/" in type_url:
            package = type_url.rsplit("/", 1)[1].rsplit(".", 1)[0]
            try:
                spec = importlib.util.find_spec(package)
            except (ImportError, ValueError):
                spec = None
            for location in (spec.submodule_search_locations or []) if spec else []:
                for module in sorted(Path(location).glob("*_pb2.py")):
                    importlib.import_module(f"{package}.{module.stem}")
        for value in data.values():
            register_types(value)
    elif isinstance(data, list):
        for value in data:
            register_types(value)


def parse_proto(data: Any, message_type: type, where: str) -> Any:
    if not isinstance(data, dict):
        raise Failed(f"{where}: expected a map, found {type(data).__name__}")
    register_types(data)
    try:
        return json_format.ParseDict(data, message_type(), ignore_unknown_fields=False)
    except json_format.ParseError as error:
        raise Failed(f"{where}: not a valid {message_type.DESCRIPTOR.full_name}:\n{proto_error(error)}")


def unpack_any(any_message: Any) -> Any:
    name = any_message.TypeName()
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(name)
    except KeyError:
        raise Failed(f"unknown type {name} in an Any")
    message = message_factory.GetMessageClass(descriptor)()
    if not any_message.Unpack(message):
        raise Failed(f"cannot unpack {name}")
    return message


WRAPPERS = {
    "google.protobuf.UInt32Value", "google.protobuf.UInt64Value", "google.protobuf.Int32Value",
    "google.protobuf.Int64Value", "google.protobuf.DoubleValue", "google.protobuf.FloatValue",
    "google.protobuf.BoolValue", "google.protobuf.StringValue",
}


def is_repeated(fd: FieldDescriptor) -> bool:
    flag = getattr(fd, "is_repeated", None)
    if flag is not None:
        return bool(flag() if callable(flag) else flag)
    return fd.label == FieldDescriptor.LABEL_REPEATED


def is_map(fd: FieldDescriptor) -> bool:
    return is_repeated(fd) and fd.message_type is not None and fd.message_type.GetOptions().map_entry


def is_set(message: Any, fd: FieldDescriptor) -> bool:
    if is_repeated(fd):
        return len(getattr(message, fd.name)) > 0
    if fd.message_type is not None or fd.has_presence:
        return message.HasField(fd.name)
    return getattr(message, fd.name) != fd.default_value


def duration_value(d: Any) -> float:
    return d.seconds + d.nanos / 1e9


def check_numeric(problems: list[str], path: str, value: float, rules: Any) -> None:
    for bound, ok in (("gt", lambda v, b: v > b), ("gte", lambda v, b: v >= b),
                      ("lt", lambda v, b: v < b), ("lte", lambda v, b: v <= b)):
        if rules.HasField(bound) and not ok(value, getattr(rules, bound)):
            problems.append(f"{path}: {value} must be {bound} {getattr(rules, bound)}")
    if rules.HasField("const") and value != rules.const:
        problems.append(f"{path}: must be {rules.const}")
    allowed = list(getattr(rules, "in"))
    if allowed and value not in allowed:
        problems.append(f"{path}: must be one of {list(getattr(rules, 'in'))}")


def validate_proto(message: Any, path: str, problems: list[str]) -> None:
    """The subset of protoc-gen-validate rules that matter for hand-written configs:
    required messages and oneofs, string lengths, list sizes, numeric and duration bounds,
    defined enums; plus deprecated fields and enum values, which Envoy warns about or
    rejects. Recurses into set messages, maps and typed Any configs."""
    descriptor = message.DESCRIPTOR
    if descriptor.full_name == "google.protobuf.Any":
        if message.type_url:
            try:
                inner = unpack_any(message)
            except Failed as error:
                problems.append(f"{path}: {error}")
                return
            validate_proto(inner, f"{path}<{inner.DESCRIPTOR.name}>", problems)
        return
    if descriptor.full_name.startswith("google.protobuf."):
        return
    for oneof in descriptor.oneofs:
        options = oneof.GetOptions()
        if options.HasExtension(validate_pb2.required) and options.Extensions[validate_pb2.required]:
            if message.WhichOneof(oneof.name) is None:
                choices = ", ".join(f.name for f in oneof.fields)
                problems.append(f"{path}: one of {choices} is required")
    for fd in descriptor.fields:
        where = f"{path}.{fd.name}"
        options = fd.GetOptions()
        present = is_set(message, fd)
        oneof = fd.containing_oneof
        if oneof is not None and message.WhichOneof(oneof.name) != fd.name:
            continue  # rules on a oneof member apply only when it is the one set
        if present and options.deprecated:
            problems.append(f"{where}: deprecated field")
        rules = options.Extensions[validate_pb2.rules] if options.HasExtension(validate_pb2.rules) else None
        value = getattr(message, fd.name)
        if rules is not None:
            if rules.HasField("message") and rules.message.required and not present:
                problems.append(f"{where}: required")
            kind = rules.WhichOneof("type")
            if kind == "repeated" and not is_map(fd):
                r = rules.repeated
                if r.HasField("min_items") and len(value) < r.min_items:
                    problems.append(f"{where}: needs at least {r.min_items} item(s)")
                if r.HasField("max_items") and len(value) > r.max_items:
                    problems.append(f"{where}: at most {r.max_items} item(s)")
                if r.items.HasField("string") and fd.type == FieldDescriptor.TYPE_STRING:
                    for i, item in enumerate(value):
                        if r.items.string.HasField("min_len") and len(item) < r.items.string.min_len:
                            problems.append(f"{where}[{i}]: at least {r.items.string.min_len} character(s)")
            elif kind == "map":
                if rules.map.HasField("min_pairs") and len(value) < rules.map.min_pairs:
                    problems.append(f"{where}: needs at least {rules.map.min_pairs} entr(ies)")
            elif kind == "string" and not is_repeated(fd):
                s = rules.string
                if not (s.ignore_empty and value == ""):
                    if s.HasField("min_len") and len(value) < s.min_len:
                        problems.append(f"{where}: at least {s.min_len} character(s), found {value!r}")
                    if s.HasField("max_len") and len(value) > s.max_len:
                        problems.append(f"{where}: at most {s.max_len} character(s)")
                    if s.HasField("min_bytes") and len(value.encode()) < s.min_bytes:
                        problems.append(f"{where}: at least {s.min_bytes} byte(s), found {value!r}")
            elif kind == "enum" and not is_repeated(fd):
                if rules.enum.defined_only and fd.enum_type.values_by_number.get(value) is None:
                    problems.append(f"{where}: undefined enum value {value}")
            elif kind == "duration" and present:
                d, v = rules.duration, duration_value(value)
                for bound in ("gt", "gte", "lt", "lte"):
                    if d.HasField(bound):
                        b = duration_value(getattr(d, bound))
                        ok = {"gt": v > b, "gte": v >= b, "lt": v < b, "lte": v <= b}[bound]
                        if not ok:
                            problems.append(f"{where}: {v}s must be {bound} {b}s")
                if d.required and not present:
                    problems.append(f"{where}: required")
            elif kind == "any":
                if rules.any.required and not present:
                    problems.append(f"{where}: required")
            elif kind in ("uint32", "uint64", "int32", "int64", "double", "float") and not is_repeated(fd):
                number_rules = getattr(rules, kind)
                if fd.message_type is not None:
                    if present and fd.message_type.full_name in WRAPPERS:
                        check_numeric(problems, where, value.value, number_rules)
                elif not (getattr(number_rules, "ignore_empty", False) and value == 0):
                    check_numeric(problems, where, value, number_rules)
        if fd.enum_type is not None and present and not is_repeated(fd):
            enum_value = fd.enum_type.values_by_number.get(value)
            if enum_value is not None and enum_value.GetOptions().deprecated:
                problems.append(f"{where}: deprecated value {enum_value.name}")
        if fd.message_type is None or not present:
            continue
        if is_map(fd):
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.message_type is not None:
                for key in value:
                    validate_proto(value[key], f"{where}[{key}]", problems)
        elif is_repeated(fd):
            for i, item in enumerate(value):
                validate_proto(item, f"{where}[{i}]", problems)
        else:
            validate_proto(value, where, problems)


# --------------------------------------------------------------------------------------
# Route actions → descriptors


@dataclass
class Descriptor:
    domain: str
    entries: list[tuple[str, list[Any]]]  # key and the values it may take
    where: str  # which route(s) send it

    def signature(self) -> tuple:
        return (self.domain, tuple((k, tuple(map(str, v))) for k, v in self.entries))

    def label(self) -> str:
        def show(values: list[Any]) -> str:
            values = ["<absent>" if v is ABSENT else v for v in values]
            return values[0] if len(values) == 1 else "{" + "|".join(values) + "}"
        return "[" + ", ".join(f"{k}={show(v)}" for k, v in self.entries) + "]"


def header_samples(name: str) -> list[str]:
    return SAMPLE_HEADERS.get(name.lower(), SAMPLE_DEFAULT)


def action_entry(action: Any, route_cluster: str) -> tuple[str, list[Any]]:
    kind = action.WhichOneof("action_specifier")
    if kind is None:
        raise Failed("a rate limit action with no action set")
    a = getattr(action, kind)
    if kind == "remote_address":
        return "remote_address", SAMPLE_REMOTE_ADDRESS
    if kind == "masked_remote_address":
        return "masked_remote_address", SAMPLE_MASKED_REMOTE_ADDRESS
    if kind == "request_headers":
        values: list[Any] = list(header_samples(a.header_name))
        if a.skip_if_absent:
            values.append(ABSENT)
        return a.descriptor_key, values
    if kind == "query_parameters":
        values = list(SAMPLE_DEFAULT) + ([ABSENT] if a.skip_if_absent else [])
        return a.descriptor_key, values
    if kind == "generic_key":
        return a.descriptor_key or "generic_key", [a.descriptor_value]
    if kind == "header_value_match":
        return a.descriptor_key or "header_match", [a.descriptor_value]
    if kind == "query_parameter_value_match":
        return a.descriptor_key or "query_match", [a.descriptor_value]
    if kind == "source_cluster":
        return "source_cluster", ["envoy"]
    if kind == "destination_cluster":
        return "destination_cluster", [route_cluster]
    if kind == "metadata":
        return a.descriptor_key, [a.default_value or SAMPLE_DEFAULT[0]]
    raise Failed(f"check_examples.py does not model the `{kind}` action; add it")


def descriptors_of(policies: Iterable[Any], domain: str, route_cluster: str, where: str,
                   stage: int, ctx: Ctx) -> list[Descriptor]:
    out = []
    for policy in policies:
        policy_stage = policy.stage.value if policy.HasField("stage") else 0
        if policy_stage != stage:
            ctx.note(f"{where}: a rate_limits entry at stage {policy_stage} is ignored by the "
                     f"filter at stage {stage}")
            continue
        entries = [action_entry(action, route_cluster) for action in policy.actions]
        if entries:
            out.append(Descriptor(domain, entries, where))
    return out


def check_descriptor(ctx: Ctx, descriptor: Descriptor, rules: dict[str, dict[str, Level]]) -> None:
    root = rules.get(descriptor.domain)
    if root is None:
        known = ", ".join(sorted(rules)) or "none"
        raise Failed(f"domain '{descriptor.domain}' has no rules (rules have: {known})")
    keys = [k for k, _ in descriptor.entries]
    hits, misses = [], []
    for combination in itertools.product(*(v for _, v in descriptor.entries)):
        entries = [(k, v) for k, v in zip(keys, combination) if v is not ABSENT]
        if not entries:
            continue
        shown = "[" + ", ".join(f"{k}={v}" for k, v in entries) + "]"
        rule = lookup(root, entries)
        (hits if rule else misses).append(f"{shown} -> {rule.describe() if rule else 'no rule'}")
    ctx.note(f"sent by {descriptor.where}")
    for line in hits + misses:
        ctx.note(line)
    if not hits:
        ctx.fail(f"no rule in domain '{descriptor.domain}' matches {descriptor.label()}: "
                 + "; ".join(misses))


# --------------------------------------------------------------------------------------
# Envoy bootstrap


@dataclass
class EnvoyModel:
    bootstrap: Any
    clusters: dict[str, Any]
    listeners: list[tuple[str, Any]]  # (listener name, HttpConnectionManager)


# Fields of Envoy releases newer than the pinned xds-protos knows: checked for their type,
# then removed before the rest is parsed.
NEWER_FIELDS = {("hits_addend", "is_negative_hits"): bool}


def strip_newer_fields(ctx: Ctx, data: Any, parent: str = "") -> None:
    if isinstance(data, dict):
        for key in list(data):
            expected = NEWER_FIELDS.get((parent, key))
            if expected is not None:
                if not isinstance(data[key], expected):
                    raise Failed(f"{parent}.{key} must be a {expected.__name__}, found {data[key]!r}")
                ctx.note(f"{parent}.{key}: newer than the pinned xds-protos; type checked, then set aside")
                del data[key]
            else:
                strip_newer_fields(ctx, data[key], key)
    elif isinstance(data, list):
        for item in data:
            strip_newer_fields(ctx, item, parent)


def envoy_parse(ctx: Ctx, path: Path, root: Path) -> EnvoyModel:
    documents = load_yaml_documents(path)
    if len(documents) != 1:
        raise Failed(f"{rel(path, root)}: expected one YAML document, found {len(documents)}")
    strip_newer_fields(ctx, documents[0])
    bootstrap = parse_proto(documents[0], bootstrap_pb2.Bootstrap, rel(path, root))
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    listeners = []
    for listener in bootstrap.static_resources.listeners:
        for chain in listener.filter_chains:
            for network_filter in chain.filters:
                if network_filter.name == HCM_FILTER or network_filter.typed_config.TypeName() == \
                        http_connection_manager_pb2.HttpConnectionManager.DESCRIPTOR.full_name:
                    listeners.append((listener.name, unpack_any(network_filter.typed_config)))
    ctx.note(f"{len(bootstrap.static_resources.listeners)} listener(s), {len(clusters)} cluster(s)")
    return EnvoyModel(bootstrap, clusters, listeners)


def envoy_validate(ctx: Ctx, model: EnvoyModel) -> None:
    problems: list[str] = []
    validate_proto(model.bootstrap, "Bootstrap", problems)
    for problem in problems:
        ctx.fail(problem)


def ratelimit_filter_problems(config: Any, where: str) -> list[str]:
    problems = []
    if not config.domain:
        problems.append(f"{where}: domain is empty")
    if not config.HasField("rate_limit_service"):
        problems.append(f"{where}: rate_limit_service is missing (every request would pass)")
    else:
        service = config.rate_limit_service
        if service.transport_api_version != 2:  # V3
            problems.append(f"{where}: rate_limit_service.transport_api_version must be V3")
        if not service.grpc_service.HasField("envoy_grpc") and not service.grpc_service.HasField("google_grpc"):
            problems.append(f"{where}: rate_limit_service.grpc_service names no cluster")
    return problems


def envoy_filters(ctx: Ctx, model: EnvoyModel, expected_domain: str) -> list[tuple[str, Any, Any]]:
    """The HTTP filter chain: the ratelimit filter, configured, before the router (last)."""
    found = []
    if not model.listeners:
        raise Failed("no listener has an HTTP connection manager")
    for listener, hcm in model.listeners:
        names = [f.name for f in hcm.http_filters]
        where = f"listener {listener}"
        if not names or names[-1] != ROUTER_FILTER:
            ctx.fail(f"{where}: {ROUTER_FILTER} must be the last HTTP filter (found {names})")
        if RATELIMIT_FILTER not in names:
            ctx.fail(f"{where}: no {RATELIMIT_FILTER} filter (found {names})")
            continue
        if ROUTER_FILTER in names and names.index(RATELIMIT_FILTER) > names.index(ROUTER_FILTER):
            ctx.fail(f"{where}: {RATELIMIT_FILTER} must come before {ROUTER_FILTER}")
        http_filter = hcm.http_filters[names.index(RATELIMIT_FILTER)]
        if http_filter.typed_config.TypeName() != rate_limit_pb2.RateLimit.DESCRIPTOR.full_name:
            ctx.fail(f"{where}: {RATELIMIT_FILTER} typed_config is {http_filter.typed_config.TypeName()!r}")
            continue
        config = unpack_any(http_filter.typed_config)
        for problem in ratelimit_filter_problems(config, where):
            ctx.fail(problem)
        if config.domain != expected_domain:
            ctx.fail(f"{where}: domain is '{config.domain}', expected '{expected_domain}'")
        if config.rate_limits:
            ctx.fail(f"{where}: filter-level rate_limits are not modelled by check_examples.py")
        ctx.note(f"{where}: {' -> '.join(names)}; domain {config.domain}, timeout "
                 f"{duration_value(config.timeout)}s, failure_mode_deny {config.failure_mode_deny}")
        found.append((listener, hcm, config))
    return found


def envoy_clusters(ctx: Ctx, model: EnvoyModel, filters: list[tuple[str, Any, Any]]) -> None:
    """The RLS cluster exists and speaks HTTP/2; every route's cluster exists."""
    for listener, hcm, config in filters:
        name = config.rate_limit_service.grpc_service.envoy_grpc.cluster_name
        cluster = model.clusters.get(name)
        if cluster is None:
            ctx.fail(f"listener {listener}: rate limit cluster '{name}' is not defined "
                     f"(clusters: {', '.join(model.clusters)})")
            continue
        options = cluster.typed_extension_protocol_options.get(HTTP_PROTOCOL_OPTIONS)
        http2 = False
        if options is not None:
            protocol = unpack_any(options)
            http2 = protocol.explicit_http_config.HasField("http2_protocol_options")
        if not http2:
            ctx.fail(f"cluster '{name}': gRPC needs HTTP/2; set typed_extension_protocol_options."
                     f"{HTTP_PROTOCOL_OPTIONS}.explicit_http_config.http2_protocol_options")
        hosts = [
            f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
            for locality in cluster.load_assignment.endpoints for e in locality.lb_endpoints
        ]
        if not hosts:
            ctx.fail(f"cluster '{name}' has no endpoints")
        ctx.note(f"rate limit cluster '{name}': {', '.join(hosts)}")
    for listener, hcm, _ in filters:
        for vh in hcm.route_config.virtual_hosts:
            for route in vh.routes:
                if route.HasField("route") and route.route.cluster and route.route.cluster not in model.clusters:
                    ctx.fail(f"virtual host {vh.name}: route to undefined cluster '{route.route.cluster}'")


def route_label(route: Any) -> str:
    kind = route.match.WhichOneof("path_specifier")
    return f"{kind} {getattr(route.match, kind)}" if kind else "route"


def envoy_descriptors(ctx: Ctx, model: EnvoyModel, filters: list[tuple[str, Any, Any]]) -> list[Descriptor]:
    """What each route sends, as the filter assembles it: the route action's rate_limits,
    plus the virtual host's when the route has none (OVERRIDE) or asks for them (INCLUDE)."""
    by_signature: dict[tuple, Descriptor] = {}
    for listener, hcm, config in filters:
        if hcm.HasField("rds"):
            ctx.fail(f"listener {listener}: routes come from RDS; nothing to check")
        for vh in hcm.route_config.virtual_hosts:
            for route in vh.routes:
                if not route.HasField("route"):
                    continue
                action = route.route
                option = rate_limit_pb2.RateLimitPerRoute.OVERRIDE
                domain = config.domain
                per_route = route.typed_per_filter_config.get(RATELIMIT_FILTER)
                if per_route is not None:
                    per_route = unpack_any(per_route)
                    if per_route.DESCRIPTOR.full_name == rate_limit_pb2.RateLimitPerRoute.DESCRIPTOR.full_name:
                        option = per_route.vh_rate_limits
                        domain = per_route.domain or domain
                        if per_route.rate_limits:
                            ctx.fail(f"{vh.name} {route_label(route)}: per-route rate_limits are not "
                                     "modelled by check_examples.py")
                policies = list(action.rate_limits)
                include_vh = option == rate_limit_pb2.RateLimitPerRoute.INCLUDE or (
                    option == rate_limit_pb2.RateLimitPerRoute.OVERRIDE and not policies)
                if include_vh:
                    policies += list(vh.rate_limits)
                where = f"route '{route_label(route)}' of virtual host {vh.name}"
                for d in descriptors_of(policies, domain, action.cluster, where, config.stage, ctx):
                    known = by_signature.get(d.signature())
                    if known:
                        known.where += f", {where}"
                    else:
                        by_signature[d.signature()] = d
    if not by_signature:
        ctx.fail("no route sends any descriptor")
    return list(by_signature.values())


# --------------------------------------------------------------------------------------
# docker compose


def compose_schema() -> dict | None:
    try:
        resource = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
        return json.loads(resource.read_text())
    except (ModuleNotFoundError, FileNotFoundError):
        return None


def compose_load(ctx: Ctx, path: Path, root: Path) -> dict:
    documents = load_yaml_documents(path)
    if len(documents) != 1 or not isinstance(documents[0], dict):
        raise Failed(f"{rel(path, root)}: expected one YAML map")
    return documents[0]


def compose_schema_check(ctx: Ctx, compose: dict) -> None:
    schema = compose_schema()
    if schema is None:
        raise Failed("the Compose Specification schema (shipped by check-jsonschema) is not installed")
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    for error in errors:
        location = "/".join(map(str, error.absolute_path)) or "(top)"
        ctx.fail(f"{location}: {error.message}")
    ctx.note(f"validated against compose-spec.json ({schema.get('title', 'schema')})")


def parse_port(spec: Any) -> list[tuple[str, int, str]]:
    """(host ip, host port, protocol) for each published port of one ports entry."""
    if isinstance(spec, dict):
        published = spec.get("published")
        if published is None:
            return []
        ports = expand_range(str(published))
        return [(spec.get("host_ip", ""), p, spec.get("protocol", "tcp")) for p in ports]
    text = str(spec)
    protocol = "tcp"
    if "/" in text:
        text, protocol = text.rsplit("/", 1)
    if text.startswith("["):  # [ipv6]:host:container
        ip, _, rest = text[1:].partition("]:")
        parts = [ip] + rest.split(":")
    else:
        parts = text.split(":")
    if len(parts) == 1:
        return []  # container port only: a random host port
    if len(parts) == 2:
        ip, host = "", parts[0]
    else:
        ip, host = parts[0], parts[1]
    if host == "":
        return []
    return [(ip, p, protocol) for p in expand_range(host)]


def expand_range(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(text)]


def bind_mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(host path, container path, read-only) for each bind mount."""
    mounts = []
    for volume in service.get("volumes", []) or []:
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts.append((volume["source"], volume["target"], bool(volume.get("read_only"))))
            continue
        parts = str(volume).split(":")
        if len(parts) >= 2 and (parts[0].startswith((".", "/", "~"))):
            mounts.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return mounts


def compose_structure(ctx: Ctx, compose: dict, compose_dir: Path, root: Path,
                      envoy: EnvoyModel | None, serve_flags: set[str] | None) -> None:
    services = compose.get("services") or {}
    for name in COMPOSE_SERVICES:
        if name not in services:
            ctx.fail(f"service '{name}' is missing")
    published: dict[tuple[str, int, str], str] = {}
    for name, service in services.items():
        service = service or {}
        depends = service.get("depends_on") or []
        depends_map = depends if isinstance(depends, dict) else {d: {} for d in depends}
        for target, condition in depends_map.items():
            if target not in services:
                ctx.fail(f"{name}: depends_on names unknown service '{target}'")
            elif (condition or {}).get("condition") == "service_healthy":
                check = (services[target] or {}).get("healthcheck")
                if not check or check.get("disable"):
                    ctx.fail(f"{name}: waits for '{target}' to be healthy, but it has no healthcheck")
        for host, container, _ in bind_mounts(service):
            source = (compose_dir / host).resolve() if not host.startswith("/") else Path(host)
            if not source.exists():
                ctx.fail(f"{name}: mounted host path {host} does not exist")
                continue
            for item in [source] + (list(source.rglob("*")) if source.is_dir() else []):
                mode = item.stat().st_mode
                need = 0o005 if item.is_dir() else 0o004
                if mode & need != need:
                    ctx.fail(f"{name}: {rel(item, root)} is not readable by other users "
                             "(the containers run as non-root users)")
        build = service.get("build")
        if build is not None:
            context = build if isinstance(build, str) else build.get("context", ".")
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            if not (compose_dir / context / dockerfile).is_file():
                ctx.fail(f"{name}: build context {context} has no {dockerfile}")
        else:
            image = service.get("image", "")
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            if not tag or tag == "latest":
                ctx.fail(f"{name}: image '{image}' should be pinned to a tag other than latest")
        for spec in service.get("ports", []) or []:
            try:
                ports = parse_port(spec)
            except ValueError:
                ctx.fail(f"{name}: cannot read port {spec!r}")
                continue
            for ip, port, protocol in ports:
                for (other_ip, other_port, other_protocol), owner in published.items():
                    if port == other_port and protocol == other_protocol and (
                            ip in ("", "0.0.0.0") or other_ip in ("", "0.0.0.0") or ip == other_ip):
                        ctx.fail(f"{name}: host port {port}/{protocol} is also published by {owner}")
                published[(ip, port, protocol)] = name
    # turnstile services: --config names a mount, flags exist, Redis is a service.
    for name in ("turnstile-1", "turnstile-2"):
        service = services.get(name) or {}
        command = service.get("command") or []
        if isinstance(command, str):
            command = shlex.split(command)
        if serve_flags is not None:
            for arg in command:
                if arg.startswith("--") and arg.split("=", 1)[0][2:] not in serve_flags:
                    ctx.fail(f"{name}: `turnstile serve` has no flag {arg.split('=', 1)[0]}")
        config = flag_value(command, "--config")
        if config is None:
            ctx.fail(f"{name}: command has no --config")
        elif not any(config == target or config.startswith(target.rstrip("/") + "/")
                     for _, target, _ in bind_mounts(service)):
            ctx.fail(f"{name}: --config {config} is not inside a mounted directory")
        redis_url = flag_value(command, "--redis-url")
        if redis_url:
            host = re.sub(r"^rediss?://", "", redis_url).split("@")[-1].split(":")[0].split("/")[0]
            if host not in services:
                ctx.fail(f"{name}: --redis-url host '{host}' is not a service")
    # envoy: the config mount, and every upstream host a service.
    envoy_service = services.get("envoy") or {}
    if not any(host.endswith("examples/envoy/envoy.yaml") for host, _, _ in bind_mounts(envoy_service)):
        ctx.fail("envoy: does not mount ./examples/envoy/envoy.yaml")
    if envoy is not None:
        for cluster in envoy.clusters.values():
            for locality in cluster.load_assignment.endpoints:
                for endpoint in locality.lb_endpoints:
                    host = endpoint.endpoint.address.socket_address.address
                    if host not in services:
                        ctx.fail(f"envoy cluster '{cluster.name}' sends to host '{host}', "
                                 "which is not a compose service")
    ctx.note(f"services: {', '.join(services)}; published host ports: "
             f"{', '.join(str(p) for _, p, _ in sorted(published, key=lambda k: k[1]))}")


def flag_value(command: list[str], flag: str) -> str | None:
    for index, arg in enumerate(command):
        if arg == flag and index + 1 < len(command):
            return str(command[index + 1])
        if str(arg).startswith(flag + "="):
            return str(arg).split("=", 1)[1]
    return None


# --------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    instructions, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        current += " " + stripped if current else stripped
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        word, _, rest = current.partition(" ")
        instructions.append((word.upper(), rest.strip()))
        current = ""
    return instructions


def dockerignore_patterns(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [relative] + [str(Path(*Path(relative).parts[:i])) for i in range(1, len(Path(relative).parts))]
        if any(fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.replace("**/", "")) for c in candidates):
            result = not negate
    return result


def dockerfile_check(ctx: Ctx, root: Path) -> None:
    path = root / "Dockerfile"
    if not path.is_file():
        raise Failed("Dockerfile is missing")
    instructions = dockerfile_instructions(path.read_text())
    stages: list[dict] = []
    for word, rest in instructions:
        if word == "FROM":
            parts = rest.split()
            parts = [p for p in parts if not p.startswith("--")]
            stages.append({"image": parts[0], "name": parts[2] if len(parts) > 2 else None, "body": []})
        elif stages:
            stages[-1]["body"].append((word, rest))
    if len(stages) < 2:
        ctx.fail("expected a multi-stage build (a builder and a runtime stage)")
        return
    names = {s["name"] for s in stages if s["name"]}
    for stage in stages:
        image = stage["image"]
        if image in names:
            continue
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        if not tag or tag == "latest":
            ctx.fail(f"FROM {image}: pin a tag")
    builder, runtime = stages[0], stages[-1]
    runs = " ".join(rest for word, rest in builder["body"] if word == "RUN")
    if not re.search(r"cargo build\b(?=[^&;]*--release)(?=[^&;]*--locked)", runs):
        ctx.fail("the builder stage must run `cargo build --release --locked`")
    codenames = [re.search(r"(bookworm|trixie|bullseye|noble|jammy)", s["image"]) for s in (builder, runtime)]
    if all(codenames) and codenames[0].group(1) != codenames[1].group(1):
        ctx.fail(f"builder ({builder['image']}) and runtime ({runtime['image']}) are different "
                 "releases: the binary may need a newer glibc than the runtime has")
    rust = re.match(r"rust:(\d+)\.(\d+)", builder["image"])
    cargo_toml = (root / "Cargo.toml").read_text() if (root / "Cargo.toml").is_file() else ""
    need = re.search(r'rust-version\s*=\s*"(\d+)\.(\d+)', cargo_toml)
    minimum = (int(need.group(1)), int(need.group(2))) if need else \
        ((1, 85) if re.search(r'edition\s*=\s*"2024"', cargo_toml) else (1, 0))
    if rust and (int(rust.group(1)), int(rust.group(2))) < minimum:
        ctx.fail(f"{builder['image']} is older than the Rust {minimum[0]}.{minimum[1]} the crate needs")
    body = runtime["body"]
    users = [rest for word, rest in body if word == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        ctx.fail("the runtime stage must switch to a non-root USER")
    elif not users[-1].split(":")[0].isdigit():
        ctx.note("USER is a name: Kubernetes' runAsNonRoot can only verify a numeric user")
    entrypoints = [rest for word, rest in body if word == "ENTRYPOINT"]
    if not entrypoints or "/usr/local/bin/turnstile" not in entrypoints[-1]:
        ctx.fail('the runtime stage needs ENTRYPOINT ["/usr/local/bin/turnstile"]')
    exposed = {p.split("/")[0] for word, rest in body if word == "EXPOSE" for p in rest.split()}
    for port in ("8080", "8081"):
        if port not in exposed:
            ctx.fail(f"the runtime stage does not EXPOSE {port}")
    patterns = dockerignore_patterns(root / ".dockerignore")
    if not patterns:
        ctx.fail(".dockerignore is missing or empty (the context would carry target/ and .git/)")
    for must in ("target", ".git"):
        if patterns and not ignored(must, patterns):
            ctx.fail(f".dockerignore does not exclude {must}/")
    for stage in stages:
        for word, rest in stage["body"]:
            if word not in ("COPY", "ADD") or "--from" in rest:
                continue
            try:
                args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            except (ValueError, json.JSONDecodeError):
                ctx.fail(f"cannot read `{word} {rest}`")
                continue
            args = [a for a in args if not a.startswith("--")]
            for source in args[:-1]:
                if source in (".", "./"):
                    continue
                clean = source.rstrip("/")
                if not (root / clean).exists():
                    ctx.fail(f"`{word} {rest}`: {source} is not in the build context")
                elif ignored(clean, patterns):
                    ctx.fail(f"`{word} {rest}`: {source} is excluded by .dockerignore")
    # The build reads src/ and lua/ (include_str!); make sure the context has them.
    for needed in ("Cargo.toml", "Cargo.lock", "src", "lua"):
        if (root / needed).exists() and ignored(needed, patterns):
            ctx.fail(f".dockerignore excludes {needed}, which the build needs")
    ctx.note(f"stages: {' -> '.join(s['image'] for s in stages)}")


# --------------------------------------------------------------------------------------
# turnstile's own command line, for cross-checks


@dataclass
class CommandLine:
    flags: set[str]
    env: set[str]
    source: str


def turnstile_command_line(ctx: Ctx, root: Path, binary: Path | None) -> CommandLine | None:
    if binary is not None:
        try:
            done = subprocess.run([str(binary), "serve", "--help"], capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                return CommandLine(set(re.findall(r"--([a-z0-9-]+)", done.stdout)),
                                   set(re.findall(r"\[env: (\w+)=", done.stdout)), f"{binary} serve --help")
        except (OSError, subprocess.TimeoutExpired):
            pass
    cli = root / "src" / "cli.rs"
    if not cli.is_file():
        ctx.note("no turnstile binary and no src/cli.rs: flags and variables not cross-checked")
        return None
    text = cli.read_text()
    flags, env = {"help", "version"}, set()
    for attribute, field_name in re.findall(r"#\[arg\(([^\]]*?)\)\]\s*(?:///[^\n]*\s*)*pub (\w+):", text, re.S):
        if re.search(r"\blong\b", attribute):
            flags.add(field_name.replace("_", "-"))
        match = re.search(r'env\s*=\s*"(\w+)"', attribute)
        if match:
            env.add(match.group(1))
    return CommandLine(flags, env, "src/cli.rs")


# --------------------------------------------------------------------------------------
# Istio / Kubernetes


@dataclass
class K8sObject:
    doc: dict
    file: str

    @property
    def kind(self) -> str:
        return self.doc.get("kind", "")

    @property
    def name(self) -> str:
        return (self.doc.get("metadata") or {}).get("name", "")

    @property
    def namespace(self) -> str:
        return (self.doc.get("metadata") or {}).get("namespace") or "default"

    def label(self) -> str:
        return f"{self.file}: {self.kind}/{self.name}"


def istio_load(ctx: Ctx, directory: Path, root: Path) -> list[K8sObject]:
    files = sorted(directory.glob("*.yaml")) + sorted(directory.glob("*.yml"))
    if not files:
        raise Failed(f"no YAML files in {rel(directory, root)}")
    objects = []
    for file in files:
        for index, doc in enumerate(load_yaml_documents(file)):
            if doc is None:
                continue
            where = f"{rel(file, root)} document {index + 1}"
            if not isinstance(doc, dict):
                ctx.fail(f"{where}: not a map")
                continue
            pair = (doc.get("apiVersion"), doc.get("kind"))
            if pair not in ISTIO_KINDS:
                ctx.fail(f"{where}: unexpected {pair[0]}/{pair[1]} (expected one of "
                         f"{', '.join(f'{a} {k}' for a, k in sorted(ISTIO_KINDS))})")
            if not (doc.get("metadata") or {}).get("name"):
                ctx.fail(f"{where}: metadata.name is missing")
            objects.append(K8sObject(doc, rel(file, root)))
    kinds = sorted({o.kind for o in objects})
    for needed in ("EnvoyFilter", "ConfigMap", "Deployment", "Service"):
        if needed not in kinds:
            ctx.fail(f"no {needed} in {rel(directory, root)}")
    ctx.note(f"{len(objects)} objects: " + ", ".join(f"{o.kind}/{o.name}" for o in objects))
    return objects


def k8s_schema_check(ctx: Ctx, objects: list[K8sObject]) -> None:
    version = kubernetes_validate.utils.latest_version()
    checked = 0
    for obj in objects:
        if obj.kind == "EnvoyFilter":
            continue  # a CRD: checked by the EnvoyFilter checks
        try:
            kubernetes_validate.validate(obj.doc, version, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as error:
            path = "/".join(map(str, error.absolute_path)) or "(top)"
            ctx.fail(f"{obj.label()}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            ctx.fail(f"{obj.label()}: {error.message}")
    ctx.note(f"{checked} object(s) valid against the Kubernetes {version} schemas (strict)")


def envoyfilter_structure(ctx: Ctx, obj: K8sObject) -> None:
    spec = obj.doc.get("spec") or {}
    where = obj.label()
    if not (spec.get("workloadSelector") or {}).get("labels") and not spec.get("targetRefs"):
        ctx.note(f"{where}: no workloadSelector: applies to every workload in {obj.namespace}")
    patches = spec.get("configPatches") or []
    if not patches:
        ctx.fail(f"{where}: no configPatches")
    for index, patch in enumerate(patches):
        here = f"{where} configPatches[{index}]"
        if patch.get("applyTo") not in ENVOYFILTER_APPLY_TO:
            ctx.fail(f"{here}: applyTo {patch.get('applyTo')!r} is not an EnvoyFilter target")
        operation = (patch.get("patch") or {}).get("operation")
        if operation not in ENVOYFILTER_OPERATIONS:
            ctx.fail(f"{here}: patch.operation {operation!r} is not valid")
        context = (patch.get("match") or {}).get("context", "ANY")
        if context not in ENVOYFILTER_CONTEXTS:
            ctx.fail(f"{here}: match.context {context!r} is not valid")
        if "value" not in (patch.get("patch") or {}) and operation != "REMOVE":
            ctx.fail(f"{here}: patch.value is missing")


def istio_patches(objects: list[K8sObject], apply_to: str) -> list[tuple[str, dict, dict]]:
    out = []
    for obj in objects:
        if obj.kind != "EnvoyFilter":
            continue
        for index, patch in enumerate((obj.doc.get("spec") or {}).get("configPatches") or []):
            if patch.get("applyTo") == apply_to:
                out.append((f"{obj.label()} configPatches[{index}]", patch, obj.doc))
    return out


def istio_filter_patch(ctx: Ctx, objects: list[K8sObject]) -> list[Any]:
    """HTTP_FILTER patches: envoy.filters.http.ratelimit, inserted before the router, with a
    typed_config that parses as the ratelimit filter proto."""
    configs = []
    patches = istio_patches(objects, "HTTP_FILTER")
    if not patches:
        raise Failed("no EnvoyFilter patch applies to HTTP_FILTER")
    for where, patch, _ in patches:
        match = patch.get("match") or {}
        listener = match.get("listener") or {}
        network = ((listener.get("filterChain") or {}).get("filter") or {})
        if network.get("name") != HCM_FILTER:
            ctx.fail(f"{where}: match.listener.filterChain.filter.name must be {HCM_FILTER}")
        operation = patch["patch"].get("operation")
        sub = (network.get("subFilter") or {}).get("name")
        if operation == "INSERT_BEFORE" and sub != ROUTER_FILTER:
            ctx.fail(f"{where}: INSERT_BEFORE should anchor on subFilter {ROUTER_FILTER} (found {sub!r})")
        if operation not in ("INSERT_BEFORE", "INSERT_FIRST"):
            ctx.fail(f"{where}: the ratelimit filter must be inserted before the router "
                     f"(INSERT_BEFORE the router), not {operation}")
        value = patch["patch"].get("value")
        http_filter = parse_proto(value, http_connection_manager_pb2.HttpFilter, f"{where} patch.value")
        if http_filter.name != RATELIMIT_FILTER:
            ctx.fail(f"{where}: patch.value.name is '{http_filter.name}', expected {RATELIMIT_FILTER}")
            continue
        if http_filter.typed_config.TypeName() != rate_limit_pb2.RateLimit.DESCRIPTOR.full_name:
            ctx.fail(f"{where}: typed_config is {http_filter.typed_config.TypeName()!r}, expected "
                     f"{rate_limit_pb2.RateLimit.DESCRIPTOR.full_name}")
            continue
        config = unpack_any(http_filter.typed_config)
        problems: list[str] = []
        validate_proto(http_filter, "HttpFilter", problems)
        for problem in problems + ratelimit_filter_problems(config, where):
            ctx.fail(problem)
        ctx.note(f"{where}: domain {config.domain}, cluster "
                 f"{config.rate_limit_service.grpc_service.envoy_grpc.cluster_name}")
        configs.append(config)
    return configs


def istio_route_patch(ctx: Ctx, objects: list[K8sObject], domain: str) -> list[Descriptor]:
    """VIRTUAL_HOST / HTTP_ROUTE patches whose values carry rate_limits actions."""
    descriptors = []
    for apply_to, message_type in (("VIRTUAL_HOST", route_components_pb2.VirtualHost),
                                   ("HTTP_ROUTE", route_components_pb2.Route)):
        for where, patch, _ in istio_patches(objects, apply_to):
            if patch["patch"].get("operation") != "MERGE":
                ctx.note(f"{where}: operation {patch['patch'].get('operation')} (rate_limits are usually MERGEd)")
            value = parse_proto(patch["patch"].get("value"), message_type, f"{where} patch.value")
            policies = list(value.rate_limits) if apply_to == "VIRTUAL_HOST" else list(value.route.rate_limits)
            problems: list[str] = []
            for index, policy in enumerate(policies):
                validate_proto(policy, f"rate_limits[{index}]", problems)
            for problem in problems:
                ctx.fail(f"{where}: {problem}")
            descriptors += descriptors_of(policies, domain, "", where, 0, ctx)
    if not descriptors:
        ctx.fail("no EnvoyFilter patch adds rate_limits actions (VIRTUAL_HOST or HTTP_ROUTE)")
    return descriptors


def istio_configmap_rules(ctx: Ctx, objects: list[K8sObject], checker: RulesChecker) -> dict[str, dict[str, Level]]:
    """Every rules file in the ConfigMaps loads; returns {configmap name: domains}."""
    out = {}
    for obj in objects:
        if obj.kind != "ConfigMap":
            continue
        data = obj.doc.get("data") or {}
        files = {k: v for k, v in data.items() if k.endswith((".yaml", ".yml"))}
        if not files:
            ctx.fail(f"{obj.label()}: no *.yaml key in data")
            continue
        merged: dict[str, Level] = {}
        with tempfile.TemporaryDirectory(prefix="check-examples-") as tmp:
            for key, text in files.items():
                (Path(tmp) / key).write_text(text)
            domains = checker.check(ctx, Path(tmp), f"{obj.label()} data")
        if domains is None:
            continue
        merged.update(domains)
        out[obj.name] = merged
    if not out and not ctx.problems:
        ctx.fail("no ConfigMap holds rules")
    return out


def container_port(container: dict, port: Any) -> int | None:
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def istio_references(ctx: Ctx, objects: list[K8sObject], filters: list[Any],
                     rules_by_configmap: dict[str, dict[str, Level]],
                     command_line: CommandLine | None) -> None:
    """Cluster name → Service and port; Service → Deployment; Deployment → ConfigMap,
    probe, Redis, variables; filter domain → rules."""
    services = {(o.name, o.namespace): o for o in objects if o.kind == "Service"}
    deployments = [o for o in objects if o.kind == "Deployment"]
    configmaps = {o.name: o for o in objects if o.kind == "ConfigMap"}
    for config in filters:
        cluster = config.rate_limit_service.grpc_service.envoy_grpc.cluster_name
        match = re.fullmatch(r"outbound\|(\d+)\|[^|]*\|([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", cluster)
        if not match:
            ctx.fail(f"cluster '{cluster}' is not Istio's outbound|<port>||<service>.<namespace>.svc.cluster.local")
            continue
        port, name, namespace = int(match.group(1)), match.group(2), match.group(3)
        service = services.get((name, namespace))
        if service is None:
            ctx.fail(f"cluster '{cluster}': no Service {name} in namespace {namespace} "
                     f"(have: {', '.join(f'{n}/{ns}' for n, ns in services)})")
            continue
        ports = [p for p in (service.doc.get("spec") or {}).get("ports") or [] if p.get("port") == port]
        if not ports:
            ctx.fail(f"cluster '{cluster}': Service {name} has no port {port}")
        elif not (str(ports[0].get("name", "")).startswith("grpc") or ports[0].get("appProtocol") in ("grpc", "http2")):
            ctx.fail(f"Service {name} port {port}: name it grpc* or set appProtocol: grpc so Istio uses HTTP/2")
        domains = set().union(*(set(d) for d in rules_by_configmap.values())) if rules_by_configmap else set()
        if config.domain not in domains:
            ctx.fail(f"the filter's domain '{config.domain}' is not in the ConfigMap rules ({', '.join(sorted(domains))})")
    for service in services.values():
        selector = (service.doc.get("spec") or {}).get("selector") or {}
        targets = [d for d in deployments
                   if selector and all(((d.doc["spec"]["template"].get("metadata") or {}).get("labels") or {}).get(k) == v
                                       for k, v in selector.items())]
        if not targets:
            ctx.fail(f"{service.label()}: selector {selector} matches no Deployment's pods")
            continue
        containers = targets[0].doc["spec"]["template"]["spec"]["containers"]
        for port in (service.doc.get("spec") or {}).get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            if not any(container_port(c, target) for c in containers):
                ctx.fail(f"{service.label()}: targetPort {target} is not a container port of {targets[0].name}")
    for deployment in deployments:
        spec = deployment.doc["spec"]
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        labels = (spec["template"].get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            ctx.fail(f"{deployment.label()}: selector {selector} does not match the pod labels {labels}")
        pod = spec["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        for container in pod.get("containers") or []:
            image = container.get("image", "")
            if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1]:
                ctx.fail(f"{deployment.label()}: image {image!r} should be pinned")
            if "turnstile" not in image:
                continue
            env = {e["name"]: e.get("value") for e in container.get("env") or []}
            args = [str(a) for a in container.get("args") or []]
            if command_line is not None:
                for name in env:
                    if name not in command_line.env:
                        ctx.fail(f"{deployment.label()}: turnstile reads no variable {name} "
                                 f"(per {command_line.source})")
                for arg in args:
                    if arg.startswith("--") and arg[2:].split("=")[0] not in command_line.flags:
                        ctx.fail(f"{deployment.label()}: `turnstile serve` has no flag {arg}")
            config_path = flag_value(args, "--config") or env.get("TURNSTILE_CONFIG")
            mounts = container.get("volumeMounts") or []
            rules_mounts = [m for m in mounts if config_path and (
                config_path == m["mountPath"] or config_path.startswith(m["mountPath"].rstrip("/") + "/"))]
            if not config_path:
                ctx.fail(f"{deployment.label()}: no --config or TURNSTILE_CONFIG")
            elif not rules_mounts:
                ctx.fail(f"{deployment.label()}: the rules path {config_path} is not a volume mount")
            else:
                mount = rules_mounts[0]
                if mount.get("subPath"):
                    ctx.fail(f"{deployment.label()}: the rules are mounted with subPath, which never "
                             "sees ConfigMap updates; mount the directory")
                volume = volumes.get(mount["name"]) or {}
                configmap = (volume.get("configMap") or {}).get("name")
                if configmap not in configmaps:
                    ctx.fail(f"{deployment.label()}: volume {mount['name']} is not one of the ConfigMaps "
                             f"({', '.join(configmaps)})")
                elif configmap not in rules_by_configmap:
                    ctx.fail(f"{deployment.label()}: ConfigMap {configmap} holds no valid rules")
            if env.get("BACKEND_TYPE", "memory").lower() == "redis" or flag_value(args, "--backend") == "redis":
                url = flag_value(args, "--redis-url") or env.get("REDIS_URL") or ""
                host_port = re.sub(r"^rediss?://", "", url).split("@")[-1].split("/")[0]
                host, _, port = host_port.partition(":")
                port = int(port or 6379)
                short = host.split(".")[0]
                service = next((s for (n, _), s in services.items() if n == short), None)
                if service is None:
                    ctx.fail(f"{deployment.label()}: REDIS_URL host {host!r} is not a Service here")
                elif not any(p.get("port") == port for p in service.doc["spec"].get("ports") or []):
                    ctx.fail(f"{deployment.label()}: Service {short} has no port {port}")
            probe = container.get("readinessProbe") or {}
            get = probe.get("httpGet") or {}
            if get.get("path") != "/healthcheck":
                ctx.fail(f"{deployment.label()}: readinessProbe should GET /healthcheck")
            elif container_port(container, get.get("port")) != 8080:
                ctx.fail(f"{deployment.label()}: readinessProbe port {get.get('port')} is not the admin port 8080")


# --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent),
                        help="the repository to check (default: this script's repository)")
    parser.add_argument("--turnstile", default=os.environ.get("TURNSTILE_BIN"),
                        help="the turnstile binary for `turnstile check` (default: target/debug or "
                             "target/release when built)")
    parser.add_argument("--python-rules", action="store_true",
                        help="validate rules in Python even when a binary exists")
    parser.add_argument("-v", "--verbose", action="store_true", help="show what each check saw")
    args = parser.parse_args()

    root = Path(args.root).resolve()
    report = Report(args.verbose)
    binary = None if args.python_rules else find_turnstile(root, args.turnstile)
    if binary is not None and not binary.is_file():
        print(f"check_examples: {binary} does not exist", file=sys.stderr)
        return 2
    print(f"checking {root} (rules validated by {binary or 'check_examples.py'})")
    checker = RulesChecker(binary)
    command_line = turnstile_command_line(Ctx(), root, binary)

    # Rules the Envoy example uses.
    rules = report.run("rules: config/ loads", lambda ctx: checker.check(ctx, root / "config", "config"))

    # Envoy: the demo's bootstrap, and the concurrency-limit example.
    envoy = None
    for name in ("envoy.yaml", "concurrency.yaml"):
        path = root / "examples" / "envoy" / name
        model = report.run(f"envoy: examples/envoy/{name} parses as a v3 Bootstrap", envoy_parse, path, root)
        if name == "envoy.yaml":
            envoy = model
        if not model:
            continue
        report.run(f"envoy: {name}: protoc-gen-validate rules and no deprecated fields", envoy_validate, model)
        filters = report.run(f"envoy: {name}: {RATELIMIT_FILTER} (domain edge) before the router",
                             envoy_filters, model, "edge")
        report.run(f"envoy: {name}: rate limit cluster is HTTP/2; route clusters exist",
                   envoy_clusters, model, filters or [])
        if filters and rules:
            descriptors = report.run(f"envoy: {name}: routes produce descriptors", envoy_descriptors, model, filters)
            for descriptor in descriptors if isinstance(descriptors, list) else []:
                report.run(f"envoy: {name}: descriptor {descriptor.label()} matches a rule",
                           check_descriptor, descriptor, rules)

    # docker compose.
    compose_path = root / "docker-compose.yml"
    compose = report.run("compose: docker-compose.yml loads", compose_load, compose_path, root)
    if compose:
        report.run("compose: valid against the Compose Specification schema", compose_schema_check, compose)
        report.run("compose: services, depends_on, mounts, builds, ports, images",
                   compose_structure, compose, compose_path.parent, root, envoy or None,
                   command_line.flags if command_line else None)

    # Dockerfile.
    report.run("docker: Dockerfile and .dockerignore", dockerfile_check, root)

    # Istio.
    istio_dir = root / "examples" / "istio"
    objects = report.run("istio: examples/istio/*.yaml kinds and apiVersions", istio_load, istio_dir, root)
    if objects:
        report.run("istio: Kubernetes objects valid against their schemas", k8s_schema_check, objects)
        for obj in objects:
            if obj.kind == "EnvoyFilter":
                report.run(f"istio: {obj.label()} patch structure", envoyfilter_structure, obj)
        filters = report.run(f"istio: HTTP_FILTER patch is {RATELIMIT_FILTER} before the router",
                             istio_filter_patch, objects)
        configmap_rules = report.run("istio: ConfigMap rules load", istio_configmap_rules, objects, checker)
        if configmap_rules:
            report.run("istio: cluster, Service, Deployment, ConfigMap, Redis and probes agree",
                       istio_references, objects, filters or [], configmap_rules, command_line)
        if filters and configmap_rules:
            domain = filters[0].domain
            all_rules: dict[str, Level] = {}
            for domains in configmap_rules.values():
                all_rules.update(domains)
            descriptors = report.run("istio: route patches produce descriptors", istio_route_patch, objects, domain)
            for descriptor in descriptors if isinstance(descriptors, list) else []:
                report.run(f"istio: descriptor {descriptor.label()} matches a rule",
                           check_descriptor, descriptor, all_rules)

    print(f"examples: {report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
