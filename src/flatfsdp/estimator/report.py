"""The estimate as a table (terminal or markdown) and as JSON."""

from __future__ import annotations

from flatfsdp.estimator.rank_step import Layout, RankFigures

GIB = 2 ** 30
ROLES = ("main weights", "model weights", "gradients", "optimizer state")
KIND_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def comm_columns(rows: list[tuple[Layout, RankFigures]]) -> list[tuple[str, str]]:
    """Every (mesh dimension, collective) any row sends over, in a stable order."""
    found = {(dim, kind) for _, f in rows for dim, kinds in f.comm.items() for kind in kinds}
    order = list(KIND_SHORT)
    return sorted(found, key=lambda c: (c[0] != "world", c[0], order.index(c[1]) if c[1] in order else 9, c[1]))


def table_cells(rows: list[tuple[Layout, RankFigures]], deepspeed: list[int | None] | None = None
                ) -> tuple[list[str], list[list[str]], str]:
    """Header, cells and their unit ("GiB", or "MiB" when every peak is under
    a GiB): sizes per rank, traffic per step per rank."""
    comms = comm_columns(rows)
    unit = "GiB" if max(f.peak for _, f in rows) >= GIB else "MiB"
    scale = GIB if unit == "GiB" else 2 ** 20

    def _gib(value: int | None) -> str:
        if value is None:
            return "--"
        return f"{value / scale:.3f}" if abs(value) < 10 * scale else f"{value / scale:.1f}"

    header = (["world", "layout"] + [r.replace(" state", "") for r in ROLES] + ["persistent", "transient",
              "activations", "peak"] + [f"{KIND_SHORT.get(k, k)} {d}" for d, k in comms])
    if deepspeed is not None:
        header.append("DeepSpeed")
    cells = []
    for index, (layout, f) in enumerate(rows):
        line = [str(layout.world), layout.describe()] + [_gib(f.persistent.get(r, 0)) for r in ROLES]
        line += [_gib(sum(f.persistent.values())), _gib(f.engine_transient_peak), _gib(f.activations_peak),
                 _gib(f.peak)]
        line += [_gib(f.comm.get(d, {}).get(k)) for d, k in comms]
        if deepspeed is not None:
            line.append(_gib(deepspeed[index]))
        cells.append(line)
    return header, cells, unit


def add_time_columns(header: list[str], cells: list[list[str]], predictions: list, picks: dict[int, int]) -> None:
    """Append predicted step s, exposed communication per link (s) and TFLOP/s per
    rank to each row; "<-" marks the row to pick at its world size."""
    tiers = sorted({t for p in predictions for t in p.exposed})
    header += ["step s"] + [f"exposed {t} s" for t in tiers] + ["TFLOP/s/rank", "pick"]
    chosen = set(picks.values())
    for index, (line, p) in enumerate(zip(cells, predictions)):
        line += [_seconds(p.step_s)] + [_seconds(p.exposed.get(t, 0.0)) for t in tiers]
        line += [f"{p.tflops:.3g}", "<-" if index in chosen else ""]


def _seconds(value: float) -> str:
    return f"{value:.3g}" if value >= 0.0005 else "0"


def text_table(header: list[str], cells: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header] + cells) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(row) for row in cells])


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def as_json(model: str, rows: list[tuple[Layout, RankFigures]], deepspeed: list[int | None] | None,
            predictions: list | None = None, picks: dict[int, int] | None = None) -> dict:
    out = []
    for index, (layout, figures) in enumerate(rows):
        entry = {"layout": layout.__dict__ | {"describe": layout.describe()}, **figures.to_json()}
        if deepspeed is not None:
            entry["deepspeed_model_states"] = deepspeed[index]
        if predictions is not None:
            entry["time"] = predictions[index].to_json() | {"pick": index in set((picks or {}).values())}
        out.append(entry)
    return {"model": model, "unit": "bytes per rank (comm: bytes per step per rank)", "rows": out}
