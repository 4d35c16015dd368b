"""live_loop.append_trace: a resumed live call appends its trace rows, never loses earlier ones."""

import polars as pl
import pytest

from meshheal_jax.backends.live_loop import append_trace


def rows(n: int, cached: bool) -> list[dict]:
    return [
        {"stream": 0, "round": r, "kind": "generate", "latency_s": 0.1 * r, "from_cache": cached}
        for r in range(n)
    ]


def test_appends_after_the_earlier_calls_rows(tmp_path):
    path = tmp_path / "live_trace.parquet"
    assert append_trace(path, rows(3, False)) == path
    assert append_trace(path, rows(5, True)) == path
    trace = pl.read_parquet(path)
    assert trace.height == 8 and trace["from_cache"].to_list() == [False] * 3 + [True] * 5
    assert not list(tmp_path.glob("*.partial"))  # written beside and moved into place


def test_a_column_null_in_one_call_still_combines(tmp_path):
    path = tmp_path / "live_trace.parquet"
    append_trace(path, [{"round": 0, "error": None}])
    append_trace(path, [{"round": 1, "error": "HTTP 500"}])
    assert pl.read_parquet(path)["error"].to_list() == [None, "HTTP 500"]


@pytest.mark.parametrize("old", ["unreadable", "other columns"])
def test_an_old_file_that_cannot_take_the_rows_is_kept_and_the_rows_go_beside_it(tmp_path, old):
    path = tmp_path / "live_trace.parquet"
    if old == "unreadable":
        path.write_bytes(b"not parquet")
    else:
        pl.DataFrame({"round": [[0, 1]]}).write_parquet(path)  # a list column where ints follow
    before = path.read_bytes()
    with pytest.warns(UserWarning, match="not appended to"):
        side = append_trace(path, rows(2, False))
    assert side == tmp_path / "live_trace.1.parquet" and pl.read_parquet(side).height == 2
    assert path.read_bytes() == before  # the earlier file untouched
    with pytest.warns(UserWarning):
        assert append_trace(path, rows(1, False)) == tmp_path / "live_trace.2.parquet"
