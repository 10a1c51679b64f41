"""Tables at 80 columns (a user pass): ids people copy into commands are never folded mid-word
or cut; a table too wide for the terminal becomes one record per row."""

from __future__ import annotations

from rich.console import Console
from rich.table import Column, Table

from app.cli.common import print_table
from app.cli.fleet import models_cell

ROWS = [
    ("tiny-sd", "sd1", "txt2img, img2img, inpaint", "fp32", "205 KiB / 196 KiB", "diffusers", "StableDiffusion"),
    ("tiny-gpt2", "gpt2", "text", "fp32", "1.2 MiB / 1.1 MiB", "hf-cache org/tiny-gpt2@1a2b3c4d5e", "GPT2LMHeadModel"),
]
HEADERS = ("id", "family", "kinds", "precision", "on disk / loaded", "source", "pipeline")


def models_table() -> Table:
    table = Table(Column("id", no_wrap=True), *HEADERS[1:])
    for row in ROWS:
        table.add_row(*row)
    return table


def printed(table: Table, width: int) -> str:
    out = Console(width=width, record=True, color_system=None)
    print_table(table, out)
    return out.export_text()


def test_a_table_that_fits_is_printed_as_a_table() -> None:
    wide = printed(models_table(), 200)
    [line] = [line for line in wide.splitlines() if "tiny-sd" in line]
    assert [cell.strip() for cell in line.split("│")[1:-1]] == list(ROWS[0])


def test_a_table_too_wide_becomes_one_record_per_row_with_every_value_whole() -> None:
    narrow = printed(models_table(), 80)
    lines = narrow.splitlines()
    assert max(len(line) for line in lines) <= 80 and "│" not in narrow and "…" not in narrow
    assert lines[:7] == [
        "tiny-sd",
        "  family: sd1",
        "  kinds: txt2img, img2img, inpaint",
        "  precision: fp32",
        "  on disk / loaded: 205 KiB / 196 KiB",
        "  source: diffusers",
        "  pipeline: StableDiffusion",
    ]
    assert "  source: hf-cache org/tiny-gpt2@1a2b3c4d5e" in lines


def test_status_lists_each_model_once_marking_the_warm_ones() -> None:
    assert models_cell(["tiny-gpt2", "tiny-qwen2", "tiny-sd"], ["tiny-sd", "tiny-qwen2"]) == (
        "tiny-gpt2\ntiny-qwen2*\ntiny-sd*"
    )
    assert models_cell(["tiny-sd"], ["old-model"]) == "tiny-sd\nold-model (withdrawn)"  # loaded, no longer verified
    assert models_cell([], []) == "-"
