"""Time-series classification data in the ``.ts`` format, and the sets shipped with aeon.

:func:`load_ts` reads a ``.ts`` file (the format of the UEA / UCR time-series
archives) into a padded array; :func:`load_aeon_dataset` finds one of the data
sets that the ``aeon`` package ships (``BasicMotions``, ``JapaneseVowels``, ...)
inside the installed package, without importing it. Used by
``benchmarks/gru_timeseries.py`` and notebook 08 (see docs/gru.md).

The format
----------
Lines starting with ``#`` are comments. A header of ``@`` tags comes first::

    @problemName JapaneseVowels
    @timeStamps false
    @missing false
    @univariate false
    @dimensions 12            (also spelled @dimension)
    @equalLength false
    @seriesLength 29          (only with @equalLength true)
    @classLabel true 1 2 3    (or "false"; regression sets have @targetLabel true:
                               one of the two tags is required)
    @data

then one case per line: the channels separated by ``:``, each a
comma-separated list of values, and the label last (when the set has labels)::

    1.86,1.89,1.93:-0.20,-0.19,-0.23:3

Missing values are written ``?`` (``NaN`` is read too). With ``@timeStamps
true`` a channel is a list of ``(timestamp,value)`` pairs; the timestamps are
dropped and the values kept in the order given.

Missing values and unequal lengths
----------------------------------
Every channel of every case is padded to the longest series of the file, so
that the result is one array ``(n_cases, n_channels, length)``. First every
missing value is replaced by ``missing`` (default 0.0; None keeps NaN), then
the padding appends, by default, the channel's last value (``pad="last"``: a
sequence model sees the series end and then a constant, which leaves a GRU's
last hidden state close to where the series ended); ``pad="zero"`` appends
zeros and ``pad="nan"`` NaN. With ``pad="last"`` an empty channel, which has no
last value, is filled with ``missing`` (or NaN). The original lengths are kept in
``lengths``. A file that declares ``@equalLength true`` must hold series of one
length, and of its ``@seriesLength`` when it declares one.
"""
from __future__ import annotations

import importlib.util
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["TimeSeriesSet", "load_ts", "load_aeon_dataset", "aeon_data_dir"]

PADS = ("last", "zero", "nan")
_PAIR = re.compile(r"\(([^()]*)\)")


@dataclass
class TimeSeriesSet:
    """A loaded ``.ts`` file.

    Attributes
    ----------
    X : numpy.ndarray, shape (n_cases, n_channels, length)
        The series, padded to the longest one (see the module docstring).
    y : numpy.ndarray or None
        Class indices into ``classes`` (int64) for classification sets, targets
        (float64) for regression sets (``@targetLabel true``), None without labels.
    classes : tuple of str
        Class labels in the order of their indices: ``load_ts``'s ``classes``, else the
        header's ``@classLabel`` list, else the file's labels sorted.
    lengths : numpy.ndarray, shape (n_cases,)
        Length of every case before padding (its longest channel).
    name : str
        ``@problemName`` (the file name without extension when absent).
    header : dict
        Every header tag (lower case, without ``@``) with its raw value.
    """

    X: np.ndarray
    y: np.ndarray | None
    classes: tuple
    lengths: np.ndarray
    name: str
    header: dict = field(default_factory=dict, repr=False)

    @property
    def n_channels(self) -> int:
        return int(self.X.shape[1])

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def sequences(self, batch_first: bool = True) -> np.ndarray:
        """``X`` as sequences for a recurrent network: ``(n_cases, length, n_channels)``
        (``(length, n_cases, n_channels)`` with ``batch_first=False``)."""
        seq = np.ascontiguousarray(self.X.transpose(0, 2, 1))
        return seq if batch_first else np.ascontiguousarray(seq.transpose(1, 0, 2))


def _flag(value: str, tag: str, where: str) -> bool:
    v = value.strip().split()[0].lower() if value.strip() else ""
    if v not in ("true", "false"):
        raise ValueError(f"{where}: @{tag} must be 'true' or 'false', got {value.strip()!r}")
    return v == "true"


def _parse_values(text: str, timestamps: bool, where: str) -> list:
    text = text.strip()
    if timestamps:
        pairs = list(_PAIR.finditer(text))
        if text and not pairs:
            raise ValueError(f"{where}: @timeStamps is true but the channel {text[:40]!r} holds no "
                             "'(timestamp,value)' pairs")
        # between the pairs only commas: a truncated pair ("(3,4"), text between pairs or a pair without
        # its timestamp was dropped without a word
        gaps = [text[a.end(): b.start()] for a, b in zip(pairs, pairs[1:])]
        rest = text[: pairs[0].start()] + text[pairs[-1].end():] if pairs else ""
        bad = next((g for g in gaps if g.strip() != ","), None)
        if bad is None and rest.strip() not in ("", ","):
            bad = rest
        if bad is None:
            bad = next((m.group(0) for m in pairs if "," not in m.group(1)), None)
        if bad is not None:
            raise ValueError(f"{where}: @timeStamps is true but the channel {text[:60]!r} has {bad.strip()[:30]!r} "
                             "where a '(timestamp,value)' pair or the comma between two is expected")
        items = [m.group(1).rsplit(",", 1)[-1] for m in pairs]
    else:
        items = text.split(",") if text else []
        if len(items) > 1 and not items[-1].strip():  # "1,2,3," ends the list; it adds no missing value
            items.pop()
    out = []
    for item in items:
        s = item.strip()
        if s in ("?", "") or s.lower().lstrip("+-") == "nan":  # (C's printf writes a negative NaN "-nan")
            out.append(math.nan)
            continue
        try:
            v = float(s) if "_" not in s else None  # (Python's float reads "1_000" as 1000)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v):
            raise ValueError(f"{where}: {s!r} is not a finite number (missing values are written '?')") from None
        out.append(v)
    return out


def _whole(value, tag: str, where: str):
    """A header tag's whole number >= 1 (None when the tag is absent)."""
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{where}: @{tag} must be a whole number >= 1, got {value!r}")
    return n


def _target(text: str, where: str) -> float:
    """A regression target: a finite number (a missing target, '?' or NaN, is refused)."""
    try:
        v = float(text) if "_" not in text else math.nan
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise ValueError(f"{where}: @targetLabel is true but the target {text!r} is not a finite number (a case "
                         "without its target cannot be trained on: leave it out)")
    return v


def _not_utf8(path: Path) -> ValueError:
    """The error for a file that is not UTF-8 text, naming the line of its first bad byte."""
    data = path.read_bytes()
    try:
        data.decode("utf-8-sig")
        where = path.name
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        where = f"{path.name}, line {line}"
    return ValueError(f"{where}: not UTF-8 text (a byte that UTF-8 does not allow); save the file as UTF-8")


def _label_order(label: str) -> tuple:
    """Sort key of class labels: finite numbers numerically ('2' before '10'), before any other label
    (text order; 'nan' and 'inf' are text here: a NaN key would make the order depend on the input's)."""
    try:
        v = float(label) if "_" not in label else math.nan
    except ValueError:
        v = math.nan
    return (0, v, label) if math.isfinite(v) else (1, 0.0, label)


#: header tags that decide how the cases are read: one given twice with other values is an error (others, such as
#: @problemName, which a shipped file gives twice, keep the last)
_PARSING_TAGS = {"classlabel", "targetlabel", "dimensions", "serieslength", "equallength", "timestamps", "univariate"}


def load_ts(path, *, pad: str = "last", missing: float | None = 0.0, length: int | None = None,
            dtype=np.float64, classes=None) -> TimeSeriesSet:
    """Read a ``.ts`` file into a padded array (format and padding: module docstring).

    Parameters
    ----------
    path : str or Path
    pad : {"last", "zero", "nan"}
        How shorter series are extended to the longest one: with their last
        value (default), zeros or NaN.
    missing : float or None
        Value that replaces missing entries (``?``); None keeps NaN.
    length : int, optional
        Pad to this length instead of the longest series of the file (e.g. the
        same length for the train and the test split); no series may be longer.
    dtype : numpy floating dtype
        Of ``X`` (float64 by default).
    classes : list or tuple of str, optional
        The class labels in the order of their indices, in place of the header's
        ``@classLabel`` list. A file whose header lists no classes numbers the
        labels it contains (sorted, numerically when all are numbers), which can
        differ between a train and a test split: pass the same ``classes`` to both.

    Returns
    -------
    TimeSeriesSet

    Raises
    ------
    ValueError
        The file breaks the format: no ``@data`` line, neither ``@classLabel``
        nor ``@targetLabel`` in the header (or both true), a header value its
        tag does not allow, a tag that decides how cases are read (labels,
        dimensions, lengths, timestamps) given twice with other values, a tag
        after ``@data``, a case with another number of channels than
        ``@dimensions`` (or than the first case), an empty label, a label that
        ``@classLabel`` does not list, a value or regression target that is not
        a finite number, series of unequal length in a file that declares
        ``@equalLength true``, or text that is not UTF-8. The message names
        the line. Also: a series longer than ``length``, a
        ``length`` that is not a whole number >= 1, a ``dtype`` that is not a
        floating type. A trailing comma after a channel's last value is read
        as the end of the list, a ':' after an unlabelled case's last channel
        as the end of the case (aeon writes them so), and a UTF-8 byte-order
        mark is skipped.
    """
    if pad not in PADS:
        raise ValueError(f"`pad` must be one of {PADS}, got {pad!r}")
    given = None
    if classes is not None:
        if isinstance(classes, (str, bytes, set, frozenset, dict)) or not hasattr(classes, "__iter__"):
            raise TypeError(f"`classes` must be an ordered sequence of label strings (a list or tuple: the order "
                            f"gives the class indices), got {type(classes).__name__}")
        given = tuple(classes)  # (once: a generator is read a single time)
        if not all(isinstance(c, str) for c in given):
            raise TypeError(f"`classes` must be a sequence of label strings, got {given!r}")
    if missing is not None and (isinstance(missing, bool) or not isinstance(missing, numbers.Real)):
        raise TypeError(f"`missing` must be a number (the value of missing entries) or None (keep NaN), "
                        f"got {missing!r}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1):
        raise ValueError(f"`length` must be a whole number of time points >= 1 (or None: the longest series), "
                         f"got {length!r}")
    if np.dtype(dtype).kind != "f":
        raise ValueError(f"`dtype` must be a floating type (float32, float64, ...): the series are real values "
                         f"and missing ones or padding may be NaN; got {np.dtype(dtype)}")
    path = Path(path)
    header: dict = {}
    cases, labels = [], []
    in_data = False
    lineno = 0
    case_lines = []  # the line of every case, for the messages
    with open(path, encoding="utf-8-sig") as fh:  # -sig: a byte-order mark before the first tag is skipped
        lines = enumerate(fh, start=1)
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError:
                raise _not_utf8(path) from None
            line = raw.strip()
            if not line or line.startswith(("#", "%")):  # comments (UnitTest's start with '%#')
                continue
            where = f"{path.name}, line {lineno}"
            if not in_data:
                if not line.startswith("@"):
                    raise ValueError(f"{where}: expected a header tag (@...) or @data before the cases, "
                                     f"got {line[:40]!r}")
                tag, value = (line[1:].split(None, 1) + [""])[:2]  # tag, then any whitespace
                tag = tag.lower().replace("_", "")  # (older writers spell @class_label, @target_label)
                if tag == "data":
                    in_data = True
                    timestamps = _flag(header.get("timestamps", "false"), "timeStamps", where)
                    if "classlabel" not in header and "targetlabel" not in header:
                        raise ValueError(f"{where}: the header declares neither @classLabel nor @targetLabel, so "
                                         "it is unknown whether the last ':' field of a case is a label; add "
                                         "'@classLabel true <labels>' (class labels), '@targetLabel true' (numeric "
                                         "targets) or '@classLabel false' (no labels) before @data")
                    labelled = _flag(header.get("classlabel", "false"), "classLabel", where)
                    regression = _flag(header.get("targetlabel", "false"), "targetLabel", where)
                    if labelled and regression:
                        raise ValueError(f"{where}: both @classLabel and @targetLabel are true; a case has one "
                                         "label: keep the one the last ':' field holds")
                    equal = _flag(header.get("equallength", "false"), "equalLength", where)
                    declared = _whole(header.get("serieslength"), "seriesLength", where)
                    dims = header.get("dimensions")
                    n_dims = _whole(dims, "dimensions", where)
                    if _flag(header.get("univariate", "false"), "univariate", where):
                        if n_dims not in (None, 1):
                            raise ValueError(f"{where}: @univariate is true but @dimensions is {n_dims}")
                        n_dims = 1
                    classes = tuple(header.get("classlabel", "").split()[1:]) if labelled else ()
                    continue
                key = "dimensions" if tag == "dimension" else tag
                if key in _PARSING_TAGS and key in header and header[key] != value.strip():
                    raise ValueError(f"{where}: @{tag} is given twice, as {header[key]!r} and {value.strip()!r}; "
                                     "keep one")
                header[key] = value.strip()
                continue
            if line.startswith("@"):
                raise ValueError(f"{where}: header tag {line.split()[0]!r} after @data; the header's tags come "
                                 "before @data")
            fields = line.split(":")
            if labelled or regression:
                if len(fields) < 2:
                    raise ValueError(f"{where}: a case needs its channels and a label after the last ':'")
                label, fields = fields[-1].strip(), fields[:-1]
                if not label:
                    raise ValueError(f"{where}: the case has an empty label (nothing after the last ':')")
                if regression:
                    label = _target(label, where)
                labels.append(label)
            elif len(fields) > 1 and not fields[-1].strip():  # "1,2:3,4:" ends the case (aeon writes unlabelled
                fields.pop()                                        # cases so): it adds no empty channel
            if timestamps:  # a ':' may also appear inside a timestamp: rejoin and split between pairs
                joined = ":".join(fields)
                fields = re.split(r"(?<=\)):(?=\s*\()", joined) if joined else []
            if not fields:
                raise ValueError(f"{where}: the case has no channels")
            if n_dims is None:
                n_dims = len(fields)
            if len(fields) != n_dims:
                raise ValueError(f"{where}: {len(fields)} channels, but the file declares {n_dims} "
                                 "(@dimensions, or the first case)")
            cases.append([_parse_values(f, timestamps, where) for f in fields])
            case_lines.append(lineno)
    if not in_data:
        raise ValueError(f"{path.name}: no @data line; a .ts file lists its header tags, then @data, then the cases")
    if not cases:
        raise ValueError(f"{path.name}: no cases after @data")
    lengths = np.array([max(len(ch) for ch in case) for case in cases], dtype=np.int64)
    T = int(lengths.max())
    if length is not None:
        if int(length) < T:
            i = int(np.argmax(lengths))
            raise ValueError(f"{path.name}, line {case_lines[i]}: the case has length {T}, longer than "
                             f"`length`={length}; pass "
                             f"length >= {T} (or None: the longest series)")
        T = int(length)
    if equal:
        longest = int(lengths.max())
        uneven = [i for i, case in enumerate(cases) if any(len(ch) != longest for ch in case)]
        if uneven:
            raise ValueError(f"{path.name}, line {case_lines[uneven[0]]}: @equalLength is true but this case has "
                             f"series of lengths {[len(ch) for ch in cases[uneven[0]]]} (longest {longest})")
        if declared is not None and declared != longest:
            raise ValueError(f"{path.name}: @equalLength is true and @seriesLength is {declared}, but the series "
                             f"have length {longest}: a truncated or mislabelled file")
    fill = math.nan if missing is None else float(missing)
    X = np.empty((len(cases), n_dims, T), dtype=np.float64)
    for i, case in enumerate(cases):
        for d, ch in enumerate(case):
            v = np.asarray(ch, dtype=np.float64)
            v[np.isnan(v)] = fill
            X[i, d, : len(v)] = v
            if pad == "last" and len(v):
                X[i, d, len(v):] = v[-1]
            elif pad == "zero":
                X[i, d, len(v):] = 0.0
            else:
                X[i, d, len(v):] = math.nan if pad == "nan" else fill
    y = None
    if labelled:
        if given is not None:
            classes = given
        elif not classes:
            classes = tuple(sorted(set(labels), key=_label_order))
        if len(set(classes)) != len(classes):
            raise ValueError(f"{path.name}: the classes {classes} list a label twice"
                             + ("" if given is not None else " (in @classLabel)"))
        index = {c: k for k, c in enumerate(classes)}
        unknown = [i for i, lab in enumerate(labels) if lab not in index]
        if unknown:
            where = "`classes`" if given is not None else "@classLabel"
            raise ValueError(f"{path.name}, line {case_lines[unknown[0]]}: label {labels[unknown[0]]!r} is not "
                             f"among the classes of {where} {classes}")
        y = np.array([index[lab] for lab in labels], dtype=np.int64)
    elif regression:
        y = np.array(labels, dtype=np.float64)
    name = header.get("problemname") or path.stem
    return TimeSeriesSet(X.astype(dtype, copy=False), y, classes, lengths, name, header)


def aeon_data_dir() -> Path:
    """The folder of the data sets shipped with the installed ``aeon`` package (aeon is not imported).

    Raises
    ------
    ModuleNotFoundError
        aeon is not installed.
    """
    spec = importlib.util.find_spec("aeon")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the time-series data sets are read from the files shipped with the `aeon` package, which is not "
            "installed: run `pip install aeon` (it is listed in requirements-dev.txt)", name="aeon")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"


def load_aeon_dataset(name: str, split: str = "train", **kwargs) -> TimeSeriesSet:
    """One split of a data set that ships inside the ``aeon`` package, read with :func:`load_ts`.

    The file ``aeon/datasets/data/<name>/<name>_<SPLIT>.ts`` is located
    through ``importlib.util.find_spec`` (aeon itself is never imported).

    Parameters
    ----------
    name : str
        E.g. ``"JapaneseVowels"`` (12 channels, 9 speakers, 270 train / 370
        test cases of length 7 to 29) or ``"BasicMotions"`` (6 channels, 4
        classes, 40 / 40 cases of length 100).
    split : {"train", "test"}
    **kwargs
        Passed to :func:`load_ts` (``pad``, ``missing``, ``dtype``).

    Raises
    ------
    ModuleNotFoundError
        aeon is not installed (the message says how to install it).
    FileNotFoundError
        aeon ships no such data set (the message lists those it ships).
    """
    s = str(split).upper()
    if s not in ("TRAIN", "TEST"):
        raise ValueError(f"`split` must be 'train' or 'test', got {split!r}")
    root = aeon_data_dir()
    path = root / name / f"{name}_{s}.ts"
    if not path.is_file():
        shipped = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_TRAIN.ts"))) \
            if root.is_dir() else []
        raise FileNotFoundError(f"aeon ships no file {name}/{name}_{s}.ts; data sets with .ts files: "
                                f"{', '.join(shipped) or 'none'}")
    return load_ts(path, **kwargs)
