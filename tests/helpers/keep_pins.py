"""Print pip constraints that keep what the environment's other packages pin exactly.

A machine's own tools may pin a dependency of ours exactly (awscli pins ``botocore==``): installing
our test extra then upgrades it (moto and s3fs want a newer botocore) and pip prints a red
``ERROR: ... dependency resolver`` about a package the project never uses. Given these
constraints pip picks versions of ours that fit the pin instead (an older aiobotocore), and the
install stays quiet; `tests/run.sh` falls back to an unconstrained install if no such versions
exist. In a fresh venv nothing is pinned and this prints nothing.

    python tests/helpers/keep_pins.py > constraints.txt
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import distributions

# "botocore (==1.43.11)" or "botocore==1.43.11", without environment markers or extras.
_EXACT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*\(?\s*==\s*([A-Za-z0-9._+!-]+)\s*\)?\s*$")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def exact_pins(skip: set[str]) -> dict[str, str]:
    """``{package: version}`` for each exact pin an installed distribution (other than ``skip``)
    puts on another package; a package pinned to two versions by two tools is left out (no
    constraint can keep both)."""
    pins: dict[str, set[str]] = {}
    for dist in distributions():
        owner = _canonical(dist.metadata["Name"] or "")
        if owner in skip:
            continue
        for requirement in dist.requires or ():
            if ";" in requirement:
                continue  # extras and markers: not what is installed for this tool
            match = _EXACT.match(requirement)
            if match:
                pins.setdefault(_canonical(match.group(1)), set()).add(match.group(2))
    return {name: next(iter(v)) for name, v in sorted(pins.items()) if len(v) == 1}


def main() -> None:
    for name, version in exact_pins(skip={"shardtool"}).items():
        sys.stdout.write(f"{name}=={version}\n")


if __name__ == "__main__":
    main()
