"""Why the ragged cache is read as a padded gather + one masked SDPA: one layer's decode attention, per candidate.

One decode query per (sequence, kv-head group) over ragged segments of kept entries, as after
compressing a context at rate 0.8 with a per-head allocator (segment lengths spread around the
mean). Candidates, each computing the same output (checked against the float64 reference):

- `loop`: one SDPA call per segment (kvsieve before core v2);
- `nested`: one SDPA call on nested jagged tensors (`torch.nested`, layout=torch.jagged);
- `gather+sdpa`: gather every segment into a padded `[rows, heads, width, d]` view, one SDPA
  with an additive bias that hides the padding (what kvsieve does for packed segments);
- `grid sdpa`: equal lengths, the buffers viewed as a grid, one SDPA and no gather (what
  kvsieve does when every segment holds as many entries).

Medians over repeats, in microseconds, and the ratio to `gather+sdpa`.

    python benchmarks/ragged_attention.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from kvsieve.harness.report import markdown_table
from results_io import Output

# (name, kv-heads, query heads per kv-head, head_dim, context, rows)
SHAPES = [
    ("default, 2k, batch 1", 3, 3, 64, 2048, 1),  # SmolLM2-135M: 3 kv-heads x 3 query heads, head_dim 64
    ("default, 2k, batch 4", 3, 3, 64, 2048, 4),
    ("8B-shaped, 1k, batch 1", 8, 4, 8, 1024, 1),  # decode_overhead's model: 8 kv x 4 query heads, head_dim 8
    ("8B-shaped, 1k, batch 4", 8, 4, 8, 1024, 4),
]


def ragged_lengths(segments: int, context: int, keep: float, generator: torch.Generator) -> torch.Tensor:
    """Kept entries per segment: the mean budget, spread by a per-head allocator's typical skew."""
    skew = torch.empty(segments).log_normal_(0.0, 0.6, generator=generator)
    lengths = (skew / skew.mean() * keep * context).long().clamp(8, context)
    return lengths


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tick)
    return statistics.median(times) * 1e6


def candidates(lengths: torch.Tensor, rows: int, heads: int, group: int, dim: int) -> dict[str, Callable]:
    """Every candidate as a closure over the same keys, values and queries."""
    generator = torch.Generator().manual_seed(1)
    segments, total = lengths.numel(), int(lengths.sum())
    keys, values = torch.randn(total + 1, dim, generator=generator), torch.randn(total + 1, dim, generator=generator)
    keys[-1] = values[-1] = 0.0
    query = torch.randn(rows, heads * group, 1, dim, generator=generator)
    offsets = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0)))
    width = int(lengths.max())
    slot = torch.arange(width)
    index = torch.where(slot < lengths[:, None], offsets[:-1, None] + slot, total).view(-1)
    bias = torch.zeros(segments, width).masked_fill_(slot >= lengths[:, None], float("-inf"))
    bias = bias.view(rows, heads, 1, width).repeat_interleave(group, 1)
    pieces = [(keys[a:b], values[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    grouped = query.view(segments, group, 1, dim)
    nested = [torch.nested.nested_tensor_from_jagged(t[:-1], offsets) for t in (keys, values)]
    nested = [t.unflatten(-1, (1, dim)).transpose(1, 2) for t in nested]
    nested_query = torch.nested.nested_tensor_from_jagged(
        grouped.reshape(-1, dim), torch.arange(segments + 1) * group
    ).unflatten(-1, (1, dim))
    nested_query = nested_query.transpose(1, 2)
    mean = total // segments
    grid = [t[: segments * mean].view(rows, heads, mean, dim) for t in (keys, values)]

    def loop() -> torch.Tensor:
        outs = [
            F.scaled_dot_product_attention(grouped[s][None], k[None, None], v[None, None], enable_gqa=True)
            for s, (k, v) in enumerate(pieces)
        ]
        return torch.cat(outs).view(rows, heads * group, 1, dim)

    def nested_sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(nested_query, *nested, enable_gqa=True)
        return out.transpose(1, 2).values().view(rows, heads * group, 1, dim)

    def gather_sdpa() -> torch.Tensor:
        k = keys.index_select(0, index).view(rows, heads, width, dim)
        v = values.index_select(0, index).view(rows, heads, width, dim)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=bias, enable_gqa=True)

    def grid_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, grid[0], grid[1], enable_gqa=True)

    def reference() -> torch.Tensor:
        k = keys.index_select(0, index).view(rows, heads, width, dim).double().repeat_interleave(group, 1)
        v = values.index_select(0, index).view(rows, heads, width, dim).double().repeat_interleave(group, 1)
        weights = torch.softmax(query.double() @ k.transpose(-1, -2) * dim**-0.5 + bias.double(), -1)
        return (weights @ v).float()

    return {
        "loop": loop,
        "nested": nested_sdpa,
        "gather+sdpa": gather_sdpa,
        "grid sdpa": grid_sdpa,
        "_reference": reference,
    }


def markdown(report: dict) -> str:
    """The report as a Markdown table: microseconds per candidate and shape, and the ratio to `gather+sdpa`."""
    labels = {"loop": "loop (1 call per segment)", "nested": "nested jagged SDPA"}
    labels |= {"gather+sdpa": "gather + masked SDPA", "grid sdpa": "grid SDPA (equal lengths)"}
    body = []
    for row in report["rows"]:
        base = row["median_us"]["gather+sdpa"]
        cells = [f"{t:.0f} ({t / base:.{1 if t >= 10 * base else 2}f}x)" for t in row["median_us"].values()]
        body.append([row["shape"], str(row["segments"]), *cells])
    header = ["shape", "segments", *(labels.get(name, name) for name in report["rows"][0]["median_us"])]
    return markdown_table(header, body) + "\n"


TABLE = Output("ragged_attention", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*nested.*")
    console, rows_out = Console(), []
    table = Table(
        title=f"one layer's decode attention over ragged segments, rate 0.8, {torch.get_num_threads()} threads"
    )
    for column in ("shape", "segments", "loop", "nested", "gather+sdpa", "grid sdpa"):
        table.add_column(column)
    for name, heads, group, dim, context, rows in SHAPES:
        lengths = ragged_lengths(rows * heads, context, 0.2, torch.Generator().manual_seed(0))
        fns = candidates(lengths, rows, heads, group, dim)
        expected = fns.pop("_reference")()
        for label in ("loop", "nested", "gather+sdpa"):
            torch.testing.assert_close(fns[label](), expected, atol=1e-4, rtol=1e-4, msg=f"{label} differs")
        with torch.no_grad():
            times = {label: median_us(fn, args.repeats) for label, fn in fns.items()}
        base = times["gather+sdpa"]
        rows_out.append({"shape": name, "segments": rows * heads, "median_us": times})
        cells = [f"{times[label]:.0f} us ({times[label] / base:.2f}x)" for label in fns]
        table.add_row(name, str(rows * heads), *cells)
    console.print(table)
    console.print(f"wrote {TABLE.write({'threads': torch.get_num_threads(), 'rows': rows_out})}")


if __name__ == "__main__":
    main()
