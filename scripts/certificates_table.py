"""The certificates section of docs/checks.md from `python -m rlexp.check` outputs.

    python scripts/certificates_table.py outputs/check/certs/*/certificate.json

One row per certificate and rollout kind: the worst stage's figures (initial load, after one
sync, after two), the routing agreement for an MoE, the verdict, and each command."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(name: str, cert: dict) -> list[str]:
    out = []
    for kind in dict.fromkeys(s["rollout"] for s in cert["stages"]):
        stages = [s for s in cert["stages"] if s["rollout"] == kind and s["tokens"]]
        agreement = [s["routing_agreement"] for s in stages if s["routing_agreement"] is not None]
        routing = f"{min(agreement):.4f}" if agreement else "-"
        verdict = "yes" if all(s["passed"] for s in stages) else "**no**"
        tokens = sum(s["tokens"] for s in stages)
        dtype = cert["setup"]["rollout.dtype"]
        turns = f"{sum(s['samples'] for s in stages)} / {sum(s['turns'] for s in stages)}"
        out.append(f"| {name} | {dtype} | {kind} | {turns} | {tokens} | "
                   f"{max(s['p99'] for s in stages):.2g} | {max(s['max'] for s in stages):.2g} | "
                   f"{max(s['share_above'] for s in stages):.1%} | {cert['bound']:g} | {routing} | "
                   f"{verdict} |")
    return out


def main(paths: list[str]) -> None:
    certs = {Path(p).parent.name: json.load(open(p)) for p in sorted(paths)}
    print("| model | dtype | rollout | samples / turns | tokens (3 stages) | worst p99 | worst max "
          "| worst share > bound | bound | routing agreement | within bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cert in certs.items():
        print("\n".join(rows(name.rsplit("-", 1)[0], cert)))
    print()
    for cert in certs.values():
        print(f"- `{cert['command']}`")


if __name__ == "__main__":
    main(sys.argv[1:])
