"""README.md's results section is generated from the committed JSON (``python -m benchmarks.readme``), never typed."""
import pytest

from benchmarks import readme


def test_results_section_matches_the_committed_json():
    with open(readme.README) as f:
        text = f.read()
    assert text == readme.splice(text, readme.render()), "run `python -m benchmarks.readme` and commit README.md"


def test_splice_replaces_only_between_the_markers_and_needs_them():
    text = f"head\n{readme.BEGIN}\nold\n{readme.END}\ntail\n"
    assert readme.splice(text, "new\n") == f"head\n{readme.BEGIN}\nnew\n{readme.END}\ntail\n"
    with pytest.raises(ValueError, match="markers"):
        readme.splice("no markers here", "x")
