"""Print issue 15's engine-core table from `kvflow bench throughput` / `kvflow bench serve` JSON files.

    python scripts/serving_table.py OFFLINE.json MODE=SERVE.json [MODE=SERVE.json ...]

Each SERVE.json is one `kvflow bench serve --output` run (saturation or a fixed rate); MODE names
the server it ran against (in-process, split). The saturation rows compare output tokens/s with the
offline run of the same draw (same --dataset-seed and shape), the issue's >= 90 % target.
"""

from __future__ import annotations

import json
import sys


def _ms(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        offline = json.load(f)["result"]
    base = offline["output_tokens_per_s"]
    print(f"offline (same draw): {base:,.1f} output tok/s, {offline['total_tokens_per_s']:,.1f} total tok/s")
    print("| server | rate (req/s) | output tok/s | vs offline | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed |")
    print("|---|---|---|---|---|---|---|")
    for item in argv[1:]:
        mode, path = item.split("=", 1)
        with open(path) as f:
            for run in json.load(f)["runs"]:
                ttft, itl = run["ttft_ms"], run["itl_ms"]
                share = f"{run['output_throughput'] / base:.0%}" if run["request_rate"] == "inf" else ""
                print(f"| {mode} | {run['request_rate']} | {run['output_throughput']:,.1f} | {share} | "
                      f"{_ms(ttft['p50'])} / {_ms(ttft['p99'])} | {_ms(itl['p50'], 1)} / {_ms(itl['p99'], 1)} | "
                      f"{run['failed']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
