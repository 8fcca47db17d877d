"""The .ts reader (propagators.timeseries) on small files written here, and on aeon's files."""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import numpy as np
import pytest

from propagators import timeseries
from propagators.timeseries import load_aeon_dataset, load_ts

EQUAL = """# a comment
#
@problemName Tiny
@timeStamps false
@missing false
@univariate true
@equalLength true
@seriesLength 4
@classLabel true up down
@data
1,2,3,4:up
4,3.5,2,-1e-1:down

0.5,0.5,0.5,0.5:up
"""

UNEQUAL = """@problemName Ragged
@timeStamps false
@missing true
@univariate false
@dimensions 2
@equalLength false
@classLabel true a b c
@data
1,2,3:10,20,30:c
4,?:5,6,7,8,9:a
?,2,?,4,?:1:b
:7,8:a
"""

TIMESTAMPS = """@problemName Stamped
@timeStamps true
@missing false
@univariate false
@dimensions 2
@equalLength false
@targetLabel true
@data
(2007-01-01 00:00:00,1.5),(2007-01-02 00:00:00,2.5):\
(2007-01-01 00:00:00,-1),(2007-01-02 00:00:00,-2),(2007-01-03 00:00:00,-3):0.25
(2007-01-01 00:00:00,7):(2007-01-01 00:00:00,8):-3
"""


def write(tmp_path, text, name="t.ts"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_equal_length_univariate_with_labels(tmp_path):
    ds = load_ts(write(tmp_path, EQUAL))
    assert ds.name == "Tiny" and ds.classes == ("up", "down")
    assert ds.X.shape == (3, 1, 4) and ds.X.dtype == np.float64
    np.testing.assert_array_equal(ds.X[:, 0], [[1, 2, 3, 4], [4, 3.5, 2, -0.1], [0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(ds.y, [0, 1, 0])
    np.testing.assert_array_equal(ds.lengths, [4, 4, 4])
    assert ds.n_channels == 1 and ds.n_classes == 2
    seq = ds.sequences()
    assert seq.shape == (3, 4, 1) and seq[1, 1, 0] == 3.5
    assert ds.sequences(batch_first=False).shape == (4, 3, 1)


def test_unequal_lengths_and_missing_values_default_last_value_and_zero(tmp_path):
    ds = load_ts(write(tmp_path, UNEQUAL))
    assert ds.X.shape == (4, 2, 5)
    nan_free = ds.X
    assert not np.isnan(nan_free).any()
    np.testing.assert_array_equal(ds.X[0], [[1, 2, 3, 3, 3], [10, 20, 30, 30, 30]])
    np.testing.assert_array_equal(ds.X[1], [[4, 0, 0, 0, 0], [5, 6, 7, 8, 9]])  # '?' -> 0, then the last value
    np.testing.assert_array_equal(ds.X[2], [[0, 2, 0, 4, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(ds.X[3], [[0, 0, 0, 0, 0], [7, 8, 8, 8, 8]])  # an empty channel: the fill
    np.testing.assert_array_equal(ds.lengths, [3, 5, 5, 2])
    np.testing.assert_array_equal(ds.y, [2, 0, 1, 0])


def test_padding_and_missing_options(tmp_path):
    p = write(tmp_path, UNEQUAL)
    z = load_ts(p, pad="zero", missing=-1.0)
    np.testing.assert_array_equal(z.X[1], [[4, -1, 0, 0, 0], [5, 6, 7, 8, 9]])
    n = load_ts(p, pad="nan", missing=None, dtype=np.float32)
    assert n.X.dtype == np.float32
    row = n.X[2, 0]
    assert np.isnan(row[[0, 2, 4]]).all() and row[1] == 2 and row[3] == 4
    assert np.isnan(n.X[0, 0, 3:]).all() and n.X[0, 0, 2] == 3
    kept = load_ts(p, missing=None)  # NaN kept, padding with the last value (which may be NaN)
    assert np.isnan(kept.X[2, 0, 4]) and kept.X[2, 1, 4] == 1
    with pytest.raises(ValueError, match="pad"):
        load_ts(p, pad="mean")
    longer = load_ts(p, length=7)
    assert longer.X.shape == (4, 2, 7) and (longer.X[1, 1, 4:] == 9).all()
    with pytest.raises(ValueError, match="longer than `length`=4"):
        load_ts(p, length=4)


def test_timestamps_dropped_and_regression_targets(tmp_path):
    ds = load_ts(write(tmp_path, TIMESTAMPS))
    assert ds.classes == () and ds.y.dtype == np.float64
    np.testing.assert_array_equal(ds.y, [0.25, -3.0])
    np.testing.assert_array_equal(ds.X[0], [[1.5, 2.5, 2.5], [-1, -2, -3]])
    np.testing.assert_array_equal(ds.X[1], [[7, 7, 7], [8, 8, 8]])


@pytest.mark.parametrize("text, match", [
    ("@problemName x\n1,2:a\n", "header tag"),
    ("@problemName x\n@classLabel true a\n", "no @data"),
    ("@classLabel true a\n@data\n", "no cases"),
    ("@dimensions 2\n@classLabel true a\n@data\n1,2:a\n", "1 channels, but the file declares 2"),
    ("@classLabel true a b\n@data\n1,2:a\n1,2,3:1,2:b\n", "2 channels"),
    ("@classLabel true a b\n@data\n1,2:a\n1,2:z\n", "t.ts, line 4: label 'z'"),
    ("@classLabel true a\n@data\n1,x,3:a\n", "'x' is not a finite number"),
    ("@equalLength true\n@classLabel true a\n@data\n1,2:a\n1,2,3:a\n", "line 4: @equalLength is true"),
    # a file declaring a series length its series do not have (truncated): accepted before
    ("@equalLength true\n@seriesLength 5\n@classLabel true a\n@data\n1,2:a\n3,4:a\n", "@seriesLength is 5"),
    # timestamped pairs that are truncated or interleaved with text were dropped without a word
    ("@timeStamps true\n@classLabel false\n@data\n(1,2),(3,4\n", r"'\(timestamp,value\)' pair"),
    ("@timeStamps true\n@classLabel false\n@data\n(1,2),garbage,(3,4)\n", "garbage"),
    ("@timeStamps true\n@classLabel false\n@data\n(1,2),(3,4),(5,\n", r"\(5,"),
    ("@timeStamps true\n@classLabel false\n@data\n(2),(3,4)\n", r"'\(2\)'"),
    ("@classLabel maybe a\n@data\n1:a\n", "classLabel must be"),
    ("@classLabel true a\n@data\n1,2,3\n", "label after the last"),
    # a tag given twice with other values: the last one was taken without a word
    ("@classLabel true a b\n@classLabel true b c\n@data\n1:b\n", "@classlabel is given twice"),
    ("@dimension 1\n@dimensions 2\n@classLabel true a\n@data\n1:a\n", "given twice, as '1' and '2'"),
    # a tag after @data was read as a case ("a case needs its channels and a label")
    ("@classLabel true a\n@data\n1:a\n@missing true\n2:a\n", "header tag '@missing' after @data"),
])
def test_format_errors_name_the_problem(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_ts(write(tmp_path, text))


def test_unlabelled_file_and_classes_from_the_data(tmp_path):
    ds = load_ts(write(tmp_path, "@classLabel false\n@data\n1,2:3\n4:5,6\n"))
    assert ds.y is None and ds.X.shape == (2, 2, 2) and ds.name == "t"
    np.testing.assert_array_equal(ds.X[1], [[4, 4], [5, 6]])
    ds = load_ts(write(tmp_path, "@classLabel true\n@data\n1,2:b\n3,4:a\n"))
    assert ds.classes == ("a", "b")
    np.testing.assert_array_equal(ds.y, [1, 0])
    # numeric labels sort as numbers ('1', '10', '2' before); `classes` numbers two splits alike
    ds = load_ts(write(tmp_path, "@classLabel true\n@data\n1:10\n2:2\n3:1\n"))
    assert ds.classes == ("1", "2", "10")
    np.testing.assert_array_equal(ds.y, [2, 1, 0])
    test = write(tmp_path, "@classLabel true\n@data\n1:c\n2:a\n", "test.ts")
    assert load_ts(test).classes == ("a", "c")  # numbered by this file's own labels
    ds = load_ts(test, classes=["a", "b", "c"])
    assert ds.classes == ("a", "b", "c")
    np.testing.assert_array_equal(ds.y, [2, 0])
    with pytest.raises(ValueError, match=r"label 'c' is not among the classes of `classes`"):
        load_ts(test, classes=("a", "b"))
    with pytest.raises(TypeError, match="sequence of label strings"):
        load_ts(test, classes="abc")
    with pytest.raises(ValueError, match=r"list a label twice \(in @classLabel\)"):
        load_ts(write(tmp_path, "@classLabel true a b a\n@data\n1:a\n"))


def test_missing_aeon_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(timeseries.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install aeon"):
        load_aeon_dataset("JapaneseVowels")
    with pytest.raises(ValueError, match="split"):
        load_aeon_dataset("JapaneseVowels", "validation")


needs_aeon = pytest.mark.skipif(importlib.util.find_spec("aeon") is None, reason="aeon is not installed")


@needs_aeon
def test_japanese_vowels_from_aeon_without_importing_it():
    code = (
        "import sys; from propagators.timeseries import load_aeon_dataset as f\n"
        "tr, te = f('JapaneseVowels', 'train'), f('JapaneseVowels', 'test')\n"
        "print(tr.X.shape, te.X.shape, tr.n_classes, int(tr.lengths.min()), int(tr.lengths.max()),\n"
        "      repr(float(tr.X[0, 0, 0])), sorted(set(tr.y.tolist())) == list(range(9)), 'aeon' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert " ".join(out) == "(270, 12, 26) (370, 12, 29) 9 7 26 1.860936 True False"
    tr = load_aeon_dataset("JapaneseVowels", "train", length=29)  # both splits at one length
    assert tr.X.shape == (270, 12, 29) and (tr.X[:, :, 26:] == tr.X[:, :, 25:26]).all()


def test_comment_lines_tab_separated_tags_and_a_bad_dimension_count(tmp_path):
    text = "%# a comment in UnitTest's style\n# and one in the usual style\n@problemName\tTabs\n" \
           "@classLabel\ttrue a b\n@data\n1,2,3:a\n4,5,6:b\n"
    ds = load_ts(write(tmp_path, text))
    assert ds.name == "Tabs" and ds.classes == ("a", "b") and ds.X.shape == (2, 1, 3)
    np.testing.assert_array_equal(ds.y, [0, 1])
    with pytest.raises(ValueError, match=r"t.ts, line 3: @dimensions must be a whole number >= 1, got 'two'"):
        load_ts(write(tmp_path, "@dimensions two\n@classLabel false\n@data\n1,2:3,4\n"))


@needs_aeon
def test_every_set_listed_as_shipped_loads():
    root = timeseries.aeon_data_dir()
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_TRAIN.ts")))
    assert "UnitTest" in names  # (its header starts with '%#' comment lines)
    for name in names:
        for split in ("train", "test"):
            ds = load_aeon_dataset(name, split)
            assert ds.X.shape[0] == len(ds.y) > 0 and not np.isnan(ds.X).any()


@needs_aeon
def test_basic_motions_and_unknown_names():
    ds = load_aeon_dataset("BasicMotions", "TEST")
    assert ds.X.shape == (40, 6, 100) and ds.classes == ("Standing", "Running", "Walking", "Badminton")
    assert np.bincount(ds.y).tolist() == [10, 10, 10, 10] and not math.isnan(float(ds.X.sum()))
    with pytest.raises(FileNotFoundError, match="BasicMotions"):
        load_aeon_dataset("NoSuchSet")


def test_a_byte_order_mark_and_trailing_commas_read_as_the_plain_file(tmp_path):
    """A BOM made the first tag 'not a header tag'; a trailing comma added a missing value (length 5)."""
    plain = load_ts(write(tmp_path, EQUAL))
    p = tmp_path / "bom.ts"
    p.write_bytes(b"\xef\xbb\xbf" + EQUAL.encode())
    bom = load_ts(p)
    assert bom.name == "Tiny" and np.array_equal(bom.X, plain.X) and np.array_equal(bom.y, plain.y)
    commas = load_ts(write(tmp_path, EQUAL.replace("4:up", "4,:up").replace("-1e-1:down", "-1e-1,:down"), "c.ts"))
    assert commas.X.shape == (3, 1, 4) and np.array_equal(commas.X, plain.X)
    assert list(commas.lengths) == [4, 4, 4]
    gap = load_ts(write(tmp_path, "@classLabel false\n@data\n1,,3:4,5,6\n", "g.ts"), missing=None)  # an inner empty value is missing
    assert gap.X.shape == (1, 2, 3) and math.isnan(gap.X[0, 0, 1])


@pytest.mark.parametrize("length", [3.7, 7.0, 0, -2, True, "5"])
def test_length_must_be_a_whole_number(tmp_path, length):
    with pytest.raises(ValueError, match="`length` must be a whole number"):
        load_ts(write(tmp_path, UNEQUAL), length=length)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, bool])
def test_dtype_must_be_floating(tmp_path, dtype):
    """An integer dtype turned the NaN of missing values and padding into arbitrary integers."""
    with pytest.raises(ValueError, match="floating"):
        load_ts(write(tmp_path, UNEQUAL), pad="nan", dtype=dtype)
    assert load_ts(write(tmp_path, UNEQUAL), dtype=np.float32).X.dtype == np.float32


# From a hostile review of the reader: files it read wrongly without a word, and arguments it took
@pytest.mark.parametrize("text, match", [
    # no label tag: the label column was read as a third channel (aeon reads it as the label)
    ("@problemName x\n@data\n1,2,3:4,5,6:1\n1,2,3:4,5,6:2\n", "neither @classLabel nor @targetLabel"),
    ("@classLabel true\n@targetLabel true\n@data\n1,2:3\n", "both @classLabel and @targetLabel"),
    ("@classLabel true\n@data\n3,4:a\n3,4:\n", "line 4: the case has an empty label"),  # was a class ''
    ("@targetLabel true\n@data\n1,2:0.5\n1,2:nan\n", "line 4: @targetLabel is true but the target 'nan'"),
    ("@targetLabel true\n@data\n1,2:?\n", "line 3: @targetLabel is true but the target '\\?'"),
    ("@targetLabel true\n@data\n1,2:x\n", "line 3: @targetLabel is true but the target 'x'"),
    ("@classLabel false\n@data\n1,inf,2\n", "'inf' is not a finite number"),  # was an infinite value
    ("@classLabel false\n@data\n1,-Infinity\n", "'-Infinity' is not a finite number"),
    ("@classLabel false\n@data\n1,1e400\n", "'1e400' is not a finite number"),
    ("@classLabel false\n@data\n1,1_000\n", "'1_000' is not a finite number"),  # was 1000.0
    ("@timeStamps true\n@classLabel true\n@data\n:a\n", "line 4: the case has no channels"),  # bare max() error
    ("@seriesLength abc\n@classLabel false\n@data\n1,2\n", "@seriesLength must be a whole number"),
    ("@seriesLength -3\n@classLabel false\n@data\n1,2\n", "@seriesLength must be a whole number"),
    ("@equalLength maybe\n@classLabel false\n@data\n1,2\n", "@equalLength must be 'true' or 'false'"),
    ("@equalLength truex\n@classLabel false\n@data\n1,2\n", "@equalLength must be 'true' or 'false'"),
    ("@univariate true\n@dimensions 2\n@classLabel false\n@data\n1,2:3,4\n", "@univariate is true but "
     "@dimensions is 2"),
])
def test_malformed_files_are_named_errors(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_ts(write(tmp_path, text))


def test_class_order_does_not_depend_on_hashing(tmp_path):
    """A label that reads as NaN broke the numeric sort (the order depended on PYTHONHASHSEED); a `classes`
    set numbered the labels in hash order; a generator was used up by the type check."""
    path = write(tmp_path, "@classLabel true\n@data\n1:3\n2:NaN\n3:1\n4:20\n5:2\n6:10\n")
    code = ("from propagators.timeseries import load_ts; ds = load_ts(%r); print(ds.classes, ds.y.tolist())"
            % str(path))
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in range(6)}
    assert outs == {"('1', '2', '3', '10', '20', 'NaN') [2, 5, 0, 4, 1, 3]\n"}
    path = write(tmp_path, "@classLabel true\n@data\n1:walk\n2:run\n", "w.ts")
    with pytest.raises(TypeError, match="ordered sequence"):
        load_ts(path, classes={"walk", "run"})
    ds = load_ts(path, classes=(c for c in ["run", "walk"]))
    assert ds.classes == ("run", "walk") and ds.y.tolist() == [1, 0]


@pytest.mark.parametrize("missing", ["abc", "1", True])
def test_missing_must_be_a_number(tmp_path, missing):
    with pytest.raises(TypeError, match="`missing` must be a number"):
        load_ts(write(tmp_path, UNEQUAL), missing=missing)


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    p = tmp_path / "latin.ts"
    p.write_bytes("@problemName x\n# Z\u00fcrich\n@classLabel false\n@data\n1,2\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.ts, line 2: not UTF-8 text"):
        load_ts(p)
    p.write_bytes("@classLabel false\n@data\n1,2\n".encode("utf-16"))
    with pytest.raises(ValueError, match="latin.ts, line 1: not UTF-8 text"):
        load_ts(p)


def test_unlabelled_cases_that_end_with_a_colon_as_aeon_writes_them(tmp_path):
    """aeon's writer ends every unlabelled case with ':' (and writes @targetlabel false); the empty field added
    an all-zero channel before, and the first fix refused the file. '-nan' is a missing value like 'nan';
    @class_label is @classLabel."""
    text = "@problemName x\n@univariate false\n@targetlabel false\n@data\n1,2,3:4,5,6:\n7,8,9:1,2,-nan:\n"
    ds = load_ts(write(tmp_path, text), missing=None)
    assert ds.X.shape == (2, 2, 3) and ds.y is None
    np.testing.assert_array_equal(ds.X[0], [[1, 2, 3], [4, 5, 6]])
    assert math.isnan(ds.X[1, 1, 2])
    ds = load_ts(write(tmp_path, "@dimensions 2\n@class_label false\n@data\n1,2:3,4:\n", "u.ts"))
    assert ds.X.shape == (1, 2, 2) and ds.y is None
    aeon = pytest.importorskip("aeon.datasets")
    X = np.arange(12.0).reshape(2, 2, 3)
    aeon.save_to_ts_file(X, None, path=str(tmp_path), problem_name="w")
    written = sorted(tmp_path.rglob("w*.ts"))
    assert written
    np.testing.assert_array_equal(load_ts(written[0]).X, X)
