"""The page of what every recovery method does when a data-parallel replica is lost and when a whole
stage is, generated from the methods' own traits (`on_replica_loss()`, `on_stage_loss`,
`lost_optimizer_shard` in `churnsim.calibration.methods`), so the table lists every registered method
and says what the code says."""

from __future__ import annotations

PAGE_INTRO = """\
What each recovery method does with data parallelism (`pipeline.data_parallel_degree` D > 1), read
from the methods' code when this site is built. A *replica loss* is a lost node whose stage keeps a
surviving replica: it heals by a copy from that replica, whatever the method, except for where a
ZeRO-1 optimizer shard comes from. A *stage loss* is a stage whose replicas are all lost before one
heals (with D = 1, every failure): the method's own recovery runs. [Data parallelism](../concepts/data-parallelism.md)
explains the rule; [the recovery methods](../concepts/methods.md) explain each method."""


def _cell(text: str) -> str:
    """One table cell: no line breaks, and a `|` that would end the cell escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def method_losses_markdown() -> str:
    from churnsim.calibration.methods import METHOD_CONFIGS

    lines = [
        "# Methods on a replica loss and a stage loss",
        "",
        PAGE_INTRO,
        "",
        "| method | on a replica loss | on a stage loss | lost ZeRO-1 optimizer shard |",
        "|---|---|---|---|",
    ]
    for name, config in METHOD_CONFIGS.items():
        shard = "—" if config.ignores_failures else f"`{config.lost_optimizer_shard}`"
        lines.append(
            f"| `{name}` ({_cell(config.label)}) | {_cell(config.on_replica_loss())} | {_cell(config.on_stage_loss)} | {shard} |"
        )
    lines.append("")
    return "\n".join(lines)
