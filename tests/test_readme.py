"""The user manual's examples: how they are found and compared (the newcomer stage runs them)."""

from __future__ import annotations

import pytest

from tests.readme_examples import (
    MANUAL,
    ROOT,
    Example,
    examples,
    json_mismatch,
    mismatch,
    text_mismatch,
)


def test_the_manual_documents_every_route_with_a_checked_example() -> None:
    found = [e for page in MANUAL for e in examples((ROOT / page).read_text(encoding="utf-8"))]
    code = "\n".join(e.code for e in found)
    for route in ("/v1/translate", "/v1/summarize", "/v1/attention", "/v1/models", "/health/live",
                  "/health/ready", "/metrics", "/v2/models/translate-en-it/infer", '"stream":true',
                  "tritonclient", "/v1/chat/completions", "/v1/completions", "/translate"):
        assert route in code, route
    # every example that talks to the server uses the documented address (the newcomer stage
    # points it at its own port); an in-process example talks to none
    talking = [e for e in found if "localhost" in e.code or e.language == "bash"]
    assert talking and all("localhost:8000" in e.code for e in talking)
    assert any("generate_running" in e.code for e in found)  # and the in-process example is checked too


def test_a_curl_example_must_document_its_output() -> None:
    with pytest.raises(ValueError, match="line 3: a curl example without its output"):
        examples("text\n\n```bash\ncurl -s localhost:8000/health/live\n```\n\nmore text\n")
    documented = examples("```bash\ncurl -s localhost:8000/x\n```\n```json\n{\"a\": 1}\n```\n"
                          "```bash\nmake serve\n```\n")
    assert [(e.code, e.output, e.line) for e in documented] == [("curl -s localhost:8000/x\n", '{"a": 1}\n', 1)]


@pytest.mark.parametrize("expected, actual", [
    ({"a": 1, "b": "x"}, {"a": 1, "b": "x"}),
    ({"a": "..."}, {"a": [1, 2]}),
    ({"a": 1, "...": "..."}, {"a": 1, "b": 2}),
    ([{"t": "..."}, 2], [{"t": None}, 2]),
])
def test_json_matches(expected: object, actual: object) -> None:
    assert json_mismatch(expected, actual) is None


@pytest.mark.parametrize("expected, actual, where", [
    ({"a": 1}, {"a": 2}, "$.a: expected 1"),
    ({"a": 1}, {"a": 1, "b": 2}, "undocumented keys ['b']"),
    ({"a": 1, "b": 2}, {"a": 1}, "missing keys ['b']"),
    ({"a": [1, 2]}, {"a": [1]}, "$.a: expected a list of 2"),
    ({"a": 1}, {"a": 1.0}, "$.a: expected 1, got 1.0"),
    ({"o": {"x": "y"}}, {"o": ["x"]}, "$.o: expected an object"),
])
def test_json_mismatches(expected: object, actual: object, where: str) -> None:
    assert where in json_mismatch(expected, actual)


def test_text_lines_with_ellipses() -> None:
    documented = "...\nname{...model=\"m\"...} 1.0\n...\nlast ...\n"
    assert text_mismatch(documented, "# head\nname{a=\"b\",model=\"m\"} 1.0\n\nx\nlast 3") is None
    assert text_mismatch(documented, "name{model=\"m\"} 1.0\nlast") is not None  # "last " needs the space
    assert text_mismatch(documented, "name{model=\"n\"} 1.0\nlast 3") is not None
    assert text_mismatch("a\nb\n", "a\n\nb\n") is None
    assert text_mismatch("a\nb\n", "a\nb\nc\n") is not None


def test_a_json_example_that_prints_no_json_mismatches() -> None:
    example = Example("bash", "curl x", "json", '{"a": 1}', 1)
    assert "not JSON" in mismatch(example, "Internal Server Error")
    assert mismatch(example, '{"a": 1}') is None
