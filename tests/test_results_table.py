"""The results table ``evalsvc run`` prints: within 100 columns, every config name whole and told
apart, and every reason in full, wrapped between words, never cut."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from evalsvc.evaluate import config_prefix, results_table
from evalsvc.types import RunResult, ScenarioResult

CONFIGS = ["qwen3-next-tiny-nb-sync-c128", "qwen3-next-tiny-noradix-ov-c4096",
           "qwen3-next-tiny-nb-sync-c4096", "qwen3-next-tiny-noradix-sync-c128"]
EXTEND = ("extend_kl_k3_mean 1.3e+01 over the limit 5.0e-04: k3 130, 20, 5 at extend positions "
          "0, 1, 2 of 96; positions 3+ at 0.0001; defect:deferred-ops-dropped acted on 8 of 8 "
          "measured requests (prefill_hit-0, prefill_hit-1, prefill_hit-2)")
MISSING = ("model /home/someone/models/qwen3-next-tiny-gone: not a local directory, and it is "
           "not a hub model id either (NAME or NAMESPACE/NAME)")


def scenario(name: str, verdict: str = "pass", reason: str = "") -> ScenarioResult:
    return ScenarioResult(name, verdict, reason, {
        "kl_k3_mean": 1.234e-4, "kl_k3_ci_low": 1.0e-4, "kl_k3_ci_high": 1.5e-4,
        "extend_kl_k3_mean": 13.0 if verdict == "fail" else 2e-5, "hit_coverage": 0.97})


def result(config: str, verdict: str, scenarios: list[ScenarioResult],
           reason: str = "") -> RunResult:
    return RunResult(config=config, fingerprint=config, model="qwen3-next-tiny", settings={},
                     requested_args={}, verdict=verdict, reason=reason, scenarios=scenarios)


RESULTS = [
    result(CONFIGS[0], "fail", [scenario("cold"), scenario("prefill_hit", "fail", EXTEND),
                                scenario("chunked_hit", "inconclusive", "hit coverage 0.10 "
                                                                        "below 0.50")]),
    result(CONFIGS[1], "pass", [scenario("cold"), scenario("decode_hit")]),
    result(CONFIGS[2], "error", [], MISSING),
    result(CONFIGS[3], "error", [], MISSING),
]


def render(results: list[RunResult], width: int = 100) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(results_table(results, "sglang-cpu: 4 configs, 120 s"))
    return console.export_text()


def words(text: str) -> list[str]:
    return text.split()


def shown_names(lines: list[str]) -> list[str]:
    """The config cells of a rendered table, a name folded onto more lines joined again."""
    rows = [line for line in lines if line.startswith("│")]
    cells = [row.split("│")[1].strip() for row in rows]
    # a name folded onto more lines is read back by joining the lines of its cell
    shown, current = [], ""
    for row, cell in zip(rows, cells, strict=True):
        scenario_cell = row.split("│")[2].strip()
        if scenario_cell and current:
            shown.append(current)
            current = ""
        current += cell
    shown.append(current)
    return shown


@pytest.mark.parametrize("width", [100, 80])
def test_the_table_fits_its_width_with_every_config_name_whole_and_unique(width):
    text = render(RESULTS, width)
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    assert "…" not in text  # nothing cut with an ellipsis (at 80 columns, folded instead)
    title = " ".join(text[:text.index("┏")].split())
    assert title == "sglang-cpu: 4 configs, 120 s; configs qwen3-next-tiny-*"
    names = ["qwen3-next-tiny-" + s for s in shown_names(lines)]
    assert list(dict.fromkeys(names)) == CONFIGS  # each config recovered, in order, told apart


def test_reasons_are_listed_whole_and_wrapped_between_words():
    text = render(RESULTS)
    # the rows name a note; the notes below the table hold each reason once, in full
    assert re.search(r"│ prefill_hit +│.*│ fail \[1\] +│", text)
    assert re.search(r"│ chunked_hit +│.*│ inconclusive \[2\] +│", text)
    assert len(re.findall(r"│ error \[3\] +│", text)) == 2  # the same reason, one note
    notes = text[text.rindex("┘") + 1:]
    first, second, third = re.split(r"^\[\d\] ", notes.strip(), flags=re.M)[1:]
    assert words(first) == words(EXTEND)  # every word whole, in order, none cut
    assert words(second) == words("hit coverage 0.10 below 0.50")
    assert words(third) == words(MISSING)
    assert "not a local directory, and it is" in " ".join(third.split())
    assert max(len(line.rstrip()) for line in notes.splitlines()) <= 100


def test_markup_in_a_reason_is_printed_as_it_is():
    reason = "engine log: [bold]x[/bold] and [red] text"
    text = render([result("m-a", "error", [], reason), result("m-b", "pass", [scenario("cold")])])
    assert "[bold]x[/bold] and [red] text" in text


def test_wide_consoles_keep_one_line_per_row():
    text = render(RESULTS, width=150)
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == 5 + 2  # 3 + 2 scenarios and two errored runs
    assert "1.23e-04 [1.0e-04,1.5e-04]" in text


def test_the_common_prefix_keeps_a_whole_part_of_each_name():
    assert config_prefix(CONFIGS) == "qwen3-next-tiny-"
    assert config_prefix(["m-eb", "m-nb"]) == "m-"
    assert config_prefix(["mamba2-eb", "mamba-x"]) == ""  # "mamba" is no whole part
    assert config_prefix(["a-b", "a-b-c"]) == "a-"
    assert config_prefix(["a-", "a-b"]) == ""  # a name that is all prefix
    assert config_prefix(["only-one"]) == ""
    assert config_prefix(["same-name", "same-name"]) == ""
