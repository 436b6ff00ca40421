"""Link latency and bandwidth between the nodes of a pipeline, from a scenario's network section.

`SiteNetwork` places the node of stage i at a named site and looks each pair up in a table of
per-site-pair delay and bandwidth; the built-in `checkfree_geo` table is the CheckFree emulator's
(`communication/communication_costs.py`, gensyn-ai/CheckFree@8d7d547, MIT; 66 pairs of 12 sites).
"""

from __future__ import annotations

import csv
import io
from functools import lru_cache
from pathlib import Path

from .churn import TRACE_DIRECTORY
from .errors import InputError
from .scenario import GIB, NetworkSpec, SiteNetwork, UniformNetwork

BUILTIN_TABLES = {"checkfree_geo": TRACE_DIRECTORY / "checkfree" / "geo_latency_bandwidth_pairs.csv"}

# Site order of the CheckFree emulator: node i sits at SITES[i % 7] (reference/checkfree.md §4.1).
CHECKFREE_EMULATOR_SITES = ("Australia", "Belgium", "Canada", "Germany", "Iowa", "NL", "London")

LinkTable = dict[tuple[str, str], tuple[float, float]]


@lru_cache(maxsize=8)
def load_site_table(name_or_path: str) -> LinkTable:
    """(site_a, site_b) → (latency_s, bandwidth_bytes_per_s), symmetric."""
    path = BUILTIN_TABLES.get(name_or_path, Path(name_or_path))
    try:
        from .safe_files import read_input_text

        if not path.exists():
            raise FileNotFoundError(path)
        rows = list(csv.DictReader(io.StringIO(read_input_text(path, what="network table"), newline="")))
    except FileNotFoundError:
        raise InputError(
            f"network table {name_or_path!r}: no such file; use 'checkfree_geo' or a CSV with "
            "columns site_a, site_b, delay_ms, bandwidth_GiB_per_s"
        ) from None
    table: LinkTable = {}
    for line_number, row in enumerate(rows, start=2):
        try:
            latency_s = float(row["delay_ms"]) / 1000.0
            bandwidth = float(row["bandwidth_GiB_per_s"]) * GIB
            a, b = row["site_a"].strip(), row["site_b"].strip()
        except (KeyError, TypeError, ValueError):
            raise InputError(
                f"{path}: line {line_number} needs site_a, site_b, delay_ms and bandwidth_GiB_per_s as numbers"
            ) from None
        if bandwidth <= 0 or latency_s < 0:
            raise InputError(f"{path}: line {line_number}: bandwidth must be > 0 and delay >= 0")
        table[(a, b)] = table[(b, a)] = (latency_s, bandwidth)
    return table


def site_of_node(network: SiteNetwork, node: int) -> str:
    return network.sites[node % len(network.sites)]


def link_between(network: NetworkSpec, node_a: int, node_b: int) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of the link from node_a to node_b."""
    if isinstance(network, UniformNetwork):
        return network.latency_s, network.bandwidth_bytes_per_s
    site_a, site_b = site_of_node(network, node_a), site_of_node(network, node_b)
    if site_a == site_b:
        return network.same_site_latency_s, network.same_site_bandwidth_bytes_per_s
    table = load_site_table(network.table)
    try:
        return table[(site_a, site_b)]
    except KeyError:
        raise InputError(f"network table {network.table!r} has no link {site_a}–{site_b}; add the pair or change network.sites") from None


def link_matrices(network: NetworkSpec, num_nodes: int) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """Latency and bandwidth matrices [a][b] over `num_nodes` nodes (diagonal: free, infinite)."""
    latency = [[0.0] * num_nodes for _ in range(num_nodes)]
    bandwidth = [[float("inf")] * num_nodes for _ in range(num_nodes)]
    for a in range(num_nodes):
        for b in range(num_nodes):
            if a != b:
                latency[a][b], bandwidth[a][b] = link_between(network, a, b)
    return tuple(map(tuple, latency)), tuple(map(tuple, bandwidth))
