"""Check Grafana dashboard JSON files against Grafana's dashboard model.

The model is grafana-foundation-sdk's (generated from Grafana's own schema). A dashboard is
decoded into the model and encoded back: a key the model does not know is dropped on the
way, and a value of the wrong kind fails or comes back changed, so the file must come back
as it went in. Usage: check_dashboard.py FILE...; exit 1 listing every difference.
"""

import json
import sys

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard


def differences(original, echoed, path="$"):
    """Where `echoed` lost or changed something of `original`."""
    if isinstance(original, dict):
        if not isinstance(echoed, dict):
            return [f"{path}: became {echoed!r}"]
        found = []
        for key, value in original.items():
            if key not in echoed:
                found.append(f"{path}.{key}: not in Grafana's model")
            else:
                found += differences(value, echoed[key], f"{path}.{key}")
        return found
    if isinstance(original, list):
        if not isinstance(echoed, list) or len(echoed) != len(original):
            return [f"{path}: list became {echoed!r}"]
        found = []
        for i, (a, b) in enumerate(zip(original, echoed)):
            found += differences(a, b, f"{path}[{i}]")
        return found
    if original != echoed:
        return [f"{path}: {original!r} became {echoed!r}"]
    return []


def check(path):
    with open(path) as file:
        original = json.load(file)
    try:
        model = Dashboard.from_json(original)
        echoed = json.loads(json.dumps(model, cls=JSONEncoder))
    except Exception as error:  # the model refused the file outright
        return [f"$: not a dashboard of Grafana's model: {error!r}"]
    return differences(original, echoed)


def main():
    register_default_plugins()
    failed = False
    for path in sys.argv[1:]:
        for difference in check(path):
            print(f"{path}: {difference}")
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
