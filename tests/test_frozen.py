"""tests/frozen.py's comparison of a smoke run with its frozen record: every entry matches, except those a record of
another CPU kind leaves unrecorded (null), which come back with this run's values."""

from frozen import compare


def test_a_recorded_entry_must_match_and_an_unrecorded_one_comes_back_with_its_value():
    got = {"weights": {"base_model": "aa", "rl_model": "bb"}, "clean_shards": {"x/kept.parquet": "cc"}}
    assert compare(got, got) == ([], {})
    assert compare(got, {**got, "weights": {"base_model": "aa", "rl_model": None}}) == ([], {"weights.rl_model": "bb"})
    assert compare(got, {**got, "weights": {"base_model": "zz", "rl_model": None}}) == (["weights.base_model"],
                                                                                        {"weights.rl_model": "bb"})
    assert compare(got, {**got, "clean_shards": {"x/kept.parquet": "dd"}})[0] == ["clean_shards.x/kept.parquet"]
    # a key only one side has differs, null or not
    assert compare(got, {**got, "release": None})[0] == ["release"]
    assert compare({**got, "release": "ee"}, got)[0] == ["release"]
