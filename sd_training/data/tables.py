"""Table sources: parquet (one unit per row group, read in record batches with pyarrow, never a whole file
in memory) and CSV (one unit per chunk of rows, located by byte offsets indexed once at start-up).

A row's image is bytes (a binary column, or Hugging Face's ``{"bytes", "path"}`` struct), a local path
(relative to ``image_root``, default: the table's folder) or an http(s) URL; every other column except
the image bytes becomes the sample's metadata, which the filters see.
"""

from __future__ import annotations

import csv
import glob
import math
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..config.dataset import DatasetConfigError
from .references import table_cells, table_reference_columns
from .sources import ShardError, Source, outside_root_error
from .stats import Stats, describe_error, error_reason, log

IMAGE_COLUMNS = ("image", "jpg", "png", "webp", "img", "image_bytes", "filepath", "file_path", "image_path", "path", "url")
CAPTION_COLUMNS = ("caption", "text", "txt", "title", "prompt")
KEY_COLUMNS = ("key", "__key__", "id")
PARQUET_BATCH_ROWS = 256  # rows materialised at a time inside a row group
# Automatic chunking of CSV rows and folder files: at most this many per unit, and at least
# MIN_AUTO_UNITS units when the data is small, so many readers (ranks x workers) all get work.
AUTO_UNIT_SAMPLES = 1000
MIN_AUTO_UNITS = 64


def auto_chunk(n: int, samples_per_shard: int) -> int:
    if samples_per_shard > 0:
        return int(samples_per_shard)
    return max(1, min(AUTO_UNIT_SAMPLES, math.ceil(n / MIN_AUTO_UNITS)))


def expand_files(spec: str, suffixes: Sequence[str], what: str) -> List[str]:
    """Files of one source: a file, a folder (recursive, by suffix), a glob or a brace pattern."""
    import braceexpand

    if os.path.isdir(spec):
        out = sorted(
            os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs if f.lower().endswith(tuple(suffixes))
        )
    else:
        out = []
        for pattern in braceexpand.braceexpand(spec):
            matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
            out.extend(matches)
    missing = [f for f in out if not os.path.isfile(f)]
    if not out or len(missing) == len(out):
        raise DatasetConfigError(f"dataset.params.path: no {what} file found for {spec!r}")
    if missing:
        raise DatasetConfigError(f"dataset.params.path: {len(missing)} {what} file(s) of {spec!r} do not exist, e.g. {missing[0]}")
    return out


def _pick(columns: Sequence[str], wanted: str, candidates: Sequence[str], key: str, source: str) -> str:
    if wanted:
        if wanted not in columns:
            raise DatasetConfigError(f"dataset.params.{key}={wanted!r}: {source} has no such column (columns: {list(columns)})")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise DatasetConfigError(
        f"dataset.params.{key}: none of the usual names {list(candidates)} is a column of {source} "
        f"(columns: {list(columns)}); set dataset.params.{key}"
    )


class _TableSource(Source):
    """Shared row -> raw sample mapping of parquet and CSV."""

    image_col: str
    caption_col: str
    cls_col: Optional[str]
    key_col: Optional[str]
    root: str

    def _setup_columns(self, columns: Sequence[str], params, where: str) -> None:
        self.image_col = _pick(columns, str(params.image_column), IMAGE_COLUMNS, "image_column", where)
        uses_captions = not params.tags.use_tags and params.idx_to_prompt is None
        self.caption_col = (
            _pick(columns, str(params.caption_column), CAPTION_COLUMNS, "caption_column", where)
            if uses_captions or params.caption_column
            else ""
        )
        self.cls_col = None
        if params.idx_to_prompt is not None:
            self.cls_col = _pick(columns, str(params.cls_key), (), "cls_key", where)
        self.key_col = next((c for c in KEY_COLUMNS if c in columns), None)
        self.timeout = float(params.io_timeout)
        self.allow_outside = bool(params.allow_paths_outside_root)
        # masked_loss: the column holding each row's mask (not read with mask_from_alpha)
        self.mask_col = (_pick(columns, str(params.mask_column), (), "mask_column", where)
                         if params.masked_loss and not params.mask_from_alpha else None)
        # edit training: the columns reference, reference2... (or one list column; see references.py)
        self.reference_cols = table_reference_columns(columns, params, where)
        self.references = int(params.references)

    def _cell_image(self, value: Any, folder: str):
        """(bytes, path, error) of an image or mask cell: bytes, HF's {"bytes", "path"} struct, a path or URL."""
        image = path = None
        if isinstance(value, dict):  # Hugging Face datasets' Image feature: {"bytes": ..., "path": ...}
            image, path = value.get("bytes"), value.get("path")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            image = bytes(value)
        elif isinstance(value, str) and value.strip():
            path = value.strip()
        if not isinstance(path, str) or not path.strip():  # a struct's path of another type: no path
            path = None
        if image is not None and not isinstance(image, (bytes, bytearray, memoryview)):
            image = None  # a struct's bytes of another type: no image (counted as missing_image)
        error = None
        if image is None and path and not path.startswith(("http://", "https://")):
            if not os.path.isabs(path):
                path = os.path.join(self.root or folder, path)
            error = outside_root_error(path, self.root or folder, self.allow_outside)
        return (bytes(image) if image else None), (path if image is None else None), error

    def _row_sample(self, row: Dict[str, Any], default_key: str, unit_name: str, folder: str) -> Dict[str, Any]:
        image, path, error = self._cell_image(row.get(self.image_col), folder)
        mask = mask_path = None
        if self.mask_col is not None and error is None:
            mask, mask_path, error = self._cell_image(row.get(self.mask_col), folder)
        references = []
        for cell in table_cells(row, self.reference_cols, self.references):
            data, ref_path, ref_error = self._cell_image(cell, folder)
            error = error or ref_error
            references.append((data, ref_path) if data is not None or ref_path else None)
        # Metadata: every column but the image, mask and reference bytes (a path or URL is kept: filters may use it).
        binary = (self.image_col, self.mask_col, *self.reference_cols)
        meta = {k: v for k, v in row.items() if k not in binary or isinstance(v, str)}
        key = row.get(self.key_col) if self.key_col else None
        return {
            "key": str(key) if key not in (None, "") else default_key,
            "url": unit_name,
            "image": image,
            "image_path": path,
            "caption": row.get(self.caption_col) if self.caption_col else None,
            "meta": meta,
            "cls": row.get(self.cls_col) if self.cls_col else None,
            "mask": mask,
            "mask_path": mask_path,
            "references": references,
            **({"error": error} if error else {}),
        }


    def _guarded_row(self, row: Dict[str, Any], default_key: str, unit_name: str, folder: str) -> Dict[str, Any]:
        """:meth:`_row_sample`, or a sample carrying the error when the row breaks it (one row, not its unit)."""
        try:
            return self._row_sample(row, default_key, unit_name, folder)
        except Exception as exn:
            return {"key": default_key, "url": unit_name, "error": (error_reason(exn), describe_error(exn))}


class ParquetSource(_TableSource):
    """Parquet files; a unit is one row group ``(file, row_group)``."""

    def __init__(self, spec: str, params):
        import pyarrow.parquet as pq

        files = expand_files(spec, (".parquet", ".pq"), "parquet")
        units: List[Tuple[str, int]] = []
        total = 0
        schema_cols: Optional[List[str]] = None
        for path in files:
            try:
                md = pq.ParquetFile(path).metadata
            except Exception as exn:  # not parquet, truncated footer...
                raise DatasetConfigError(f"dataset.params.path: cannot read parquet footer of {path}: {exn}") from exn
            if schema_cols is None:
                schema_cols = list(pq.ParquetFile(path).schema_arrow.names)
            units.extend((path, rg) for rg in range(md.num_row_groups) if md.row_group(rg).num_rows > 0)
            total += md.num_rows
        super().__init__(name=spec, units=units, num_samples=total)
        self.root = str(params.image_root)
        self._setup_columns(schema_cols or [], params, f"parquet {files[0]}")

    def describe(self, unit) -> str:
        return f"{unit[0]}#rowgroup{unit[1]}"

    def read(self, unit: Tuple[str, int], stats: Stats) -> Iterator[Dict[str, Any]]:
        import pyarrow.parquet as pq

        path, rg = unit
        name = self.describe(unit)
        try:
            pf = pq.ParquetFile(path)
            batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[rg])
            base = os.path.splitext(os.path.basename(path))[0]
            folder = os.path.dirname(path)
            r = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield self._guarded_row(row, f"{base}:{rg}:{r}", name, folder)
                    r += 1
        except (OSError, ValueError) as exn:  # missing/corrupt file; pyarrow errors derive from these
            raise ShardError("shard_unreadable", f"{name}: {exn}") from exn


# Captions can be long (LAION has some over 128 KiB, csv's default limit); records can span lines.
csv.field_size_limit(256 * 2**20)
MAX_RECORD_LINES = 1000


def _csv_lines(fh, pos: List[int]) -> Iterator[str]:
    """Lines of a binary file as text, advancing ``pos[0]`` by their byte length (for offsets).
    Undecodable bytes survive as surrogates, so one bad caption does not break its chunk."""
    while True:
        line = fh.readline()
        if not line:
            return
        pos[0] += len(line)
        yield line.decode("utf-8", errors="surrogateescape")


def _unclosed(path: str, line: int, spans: int, to_end: bool = False) -> str:
    return (f"dataset.params.path: CSV {path}: the record starting at line {line} spans {spans} lines"
            f"{' to the end of the file' if to_end else ''}: an unclosed quote merges the rows after it into one "
            'field. Close the quote (a literal quote inside a quoted field is written "")')


class CSVSource(_TableSource):
    """CSV/TSV files with a header row; a unit is a chunk of rows ``(file, byte offset, rows, first row)``."""

    def __init__(self, spec: str, params):
        files = expand_files(spec, (".csv", ".tsv"), "CSV")
        sep = str(params.csv_separator)
        self.separators: Dict[str, str] = {}
        self.headers: Dict[str, List[str]] = {}
        units: List[Tuple[str, int, int, int]] = []
        offsets: Dict[str, List[Tuple[int, int]]] = {}
        total = 0
        for path in files:
            s = "\t" if sep == "," and path.lower().endswith(".tsv") else sep
            self.separators[path] = s
            header, starts = self._index(path, s)
            self.headers[path] = header
            offsets[path] = starts
            total += len(starts)
        chunk = auto_chunk(total, int(params.samples_per_shard))
        for path in files:
            starts = offsets[path]
            for first in range(0, len(starts), chunk):
                n = min(chunk, len(starts) - first)
                units.append((path, starts[first][0], n, first))
        super().__init__(name=spec, units=units, num_samples=total)
        self.root = str(params.image_root)
        self._setup_columns(self.headers[files[0]], params, f"CSV {files[0]}")

    @staticmethod
    def _index(path: str, sep: str) -> Tuple[List[str], List[Tuple[int, int]]]:
        """Header and (byte offset, row number) of every record (quoted newlines handled by csv).

        A record that spans several lines (a quoted caption with newlines) is counted and logged; one
        that spans more than ``MAX_RECORD_LINES``, or runs to the end of the file, is an unclosed quote
        that would silently merge the rows after it into one caption: an error naming the line."""
        pos = [0]
        starts: List[Tuple[int, int]] = []
        multi_line = 0
        with open(path, "rb") as fh:
            reader = csv.reader(_csv_lines(fh, pos), delimiter=sep)
            n, last_line, spans = -1, 0, 0
            try:
                header = [h.strip() for h in next(reader)]
                last_line = reader.line_num
                start = pos[0]
                for n, row in enumerate(reader):
                    spans = reader.line_num - last_line
                    if spans > MAX_RECORD_LINES:
                        raise DatasetConfigError(_unclosed(path, last_line + 1, spans))
                    multi_line += spans > 1
                    if row:
                        starts.append((start, n))
                    last_start, last_line = start, reader.line_num
                    start = pos[0]
            except StopIteration:
                raise DatasetConfigError(f"dataset.params.path: CSV {path} is empty (a header row is required)") from None
            except csv.Error as exn:
                raise DatasetConfigError(
                    f"dataset.params.path: CSV {path}, record {n + 2} (line {reader.line_num}): {exn}. Fix or drop "
                    "that row"
                ) from None
            if spans > 1:  # the last record spans lines: a quote left open runs to the end of the file
                fh.seek(last_start)
                try:
                    list(csv.reader(_csv_lines(fh, [last_start]), delimiter=sep, strict=True))
                except csv.Error:
                    raise DatasetConfigError(_unclosed(path, last_line - spans + 1, spans, to_end=True)) from None
        if multi_line:
            log.info("CSV %s: %d record(s) span several lines (quoted newlines in a field)", path, multi_line)
        return header, starts

    def describe(self, unit) -> str:
        return f"{unit[0]}#rows{unit[3]}+{unit[2]}"

    def read(self, unit: Tuple[str, int, int, int], stats: Stats) -> Iterator[Dict[str, Any]]:
        path, offset, n_rows, first = unit
        name = self.describe(unit)
        header = self.headers[path]
        folder = os.path.dirname(path)
        base = os.path.splitext(os.path.basename(path))[0]
        try:
            fh = open(path, "rb")
        except OSError as exn:
            raise ShardError("shard_missing", f"{name}: {exn}") from exn
        with fh:
            fh.seek(offset)
            reader = csv.reader(_csv_lines(fh, [offset]), delimiter=self.separators[path])
            r = 0
            for row in reader:
                if not row:
                    continue
                if r >= n_rows:
                    break
                if len(row) != len(header):
                    detail = f"row {first + r} has {len(row)} fields, the header {len(header)}"
                    yield {"key": f"{base}:{first + r}", "url": name, "error": ("bad_row", detail)}
                    r += 1
                    continue
                yield self._guarded_row(dict(zip(header, row)), f"{base}:{first + r}", name, folder)
                r += 1
