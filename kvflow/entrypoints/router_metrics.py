"""`kvflow router`'s /metrics: every instance's own samples, labelled, then the router's counters.

Split from router.py: the text format is all this does. Each instance's samples keep their
names and gain an `instance="URL"` label (HELP and TYPE lines once per family, whoever sent them
first), so one scrape of the router shows the whole fleet. The router's own families label each
instance with its `role` too (`prefill`, `decode`, or `instance` when nothing is disaggregated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.entrypoints.router import Router


def aggregate_metrics(per_instance: list[tuple[str, str]], router: "Router") -> str:
    """Every instance's samples with an `instance` label (HELP/TYPE once per family), then the router's."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for url, text in per_instance:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if line not in headers.setdefault(family, []):
                    headers[family].append(line)
                continue
            if not line or line.startswith("#"):
                continue
            name, _, rest = line.partition(" ")
            label = f'instance="{url}"'
            if "{" in name:
                name = name.replace("{", "{" + label + ",", 1)
            else:
                name = name + "{" + label + "}"
            families.setdefault(family or name, []).append(f"{name} {rest}")
    out = []
    for family, samples in families.items():
        out += headers.get(family, []) + samples
    pool = router.instances + router.prefills
    out.append("# HELP kvflow_router_instance_up Whether the router's health check reaches the instance.")
    out.append("# TYPE kvflow_router_instance_up gauge")
    out += [f'kvflow_router_instance_up{{instance="{i.url}"}} {int(i.healthy)}' for i in pool]
    out.append("# HELP kvflow_router_disaggregated_total Requests by how their prompt was computed "
               "(on a prefill instance, or by the decode instance after a failed or missing prefill).")
    out.append("# TYPE kvflow_router_disaggregated_total counter")
    out += [f'kvflow_router_disaggregated_total{{prefill="{k}"}} {n}' for k, n in router.disaggregated.items()]
    out.append("# HELP kvflow_router_requests_total Requests forwarded and answered, by instance and its role "
               "(a disaggregated request counts once on its prefill instance, once on its decode instance).")
    out.append("# TYPE kvflow_router_requests_total counter")
    out += [f'kvflow_router_requests_total{{instance="{i.url}",role="{router.role(i)}"}} {i.requests_total}'
            for i in pool]
    out.append("# HELP kvflow_router_refused_total Requests an instance refused before computing anything "
               "(overloaded, draining): each went on to another instance, or the last refusal was the answer.")
    out.append("# TYPE kvflow_router_refused_total counter")
    out += [f'kvflow_router_refused_total{{code="{c}"}} {n}' for c, n in router.refused.items()]
    out.append("# HELP kvflow_router_decisions_total Routing decisions, by reason (cache hit, balance, load).")
    out.append("# TYPE kvflow_router_decisions_total counter")
    out += [f'kvflow_router_decisions_total{{reason="{r}"}} {n}' for r, n in router.routed.items()]
    return "\n".join(out) + "\n"
