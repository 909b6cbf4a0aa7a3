"""commpatch.testing (the synthetic log generator of the tests, benchmarks and notebook) writes what a
real run writes, so the analysis tests that use it see the real format."""

from commpatch.data.schema import SCHEMA, compact_ranks, expand_ranks
from commpatch.testing import make_log, write_binary_run, write_rank_files


def test_group_ranks_in_the_recorders_range_notation():
    df = make_log(world_size=4, steps=2)
    assert set(df["group_ranks"].astype(str)) == {compact_ranks(range(4))} == {"0-3"}
    assert expand_ranks("0-3") == [0, 1, 2, 3]


def test_csv_and_binary_runs_read_back_with_the_same_group_notation(tmp_path):
    import commpatch

    write_rank_files(str(tmp_path / "csv"), world_size=4, steps=2)
    write_binary_run(str(tmp_path / "bin"), world_size=8, rows=100)
    csv = commpatch.read_csv(str(tmp_path / "csv"))
    binary = commpatch.read_csv(str(tmp_path / "bin"))
    assert list(csv.columns) == list(binary.columns) == [c.name for c in SCHEMA]
    assert set(csv["group_ranks"].astype(str)) == {"0-3"}
    assert "0-7" in set(binary["group_ranks"].astype(str))
