"""benchmarks/ragged_decode.py times both walks of a batch's KV cache and checks that they choose the same
tokens."""


def test_both_walks_choose_the_same_tokens(tmp_path):
    import json

    from benchmarks.ragged_decode import main

    out = tmp_path / "ragged.json"
    result = main(["--target", "tiny", "--rows", "3", "--slots", "600", "--longest", "500", "--runs", "1",
                   "--out", str(out)])
    assert result["slots"] == 1024  # allocated as the walk tiles it
    assert [c["case"] for c in result["cases"]] == ["all short", "one long", "all long", "spread", "all at the mean"]
    assert all(c["same_tokens"] for c in result["cases"])
    assert [c["lengths"] for c in result["cases"]][1] == [187, 187, 500]
    assert json.loads(out.read_text())["cases"] == result["cases"]
