// The parquet reader (parquet.h): pyarrow reads record batches; a few lines of Python turn each
// into JSON texts, which the C++ side hands on one by one with the GIL held.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "python/parquet.h"

#include <exception>

#include <fmt/format.h>

#include "python/interpreter.h"
#include "tiller/core/error.h"

namespace tiller::python {

#if TILLER_HAVE_PYTHON
namespace {

// batches(path) yields lists of JSON texts, kParquetBatchRows rows each.
constexpr const char* kReaderSource = R"PY(
import json, math, datetime, decimal

def _plain(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode('utf-8', errors='replace')
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if v is None or isinstance(v, (str, int, bool)):
        return v
    return str(v)

def batches(path, rows):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError('pyarrow is not installed in the embedded Python (pip install pyarrow)') from e
    f = pq.ParquetFile(path)
    for batch in f.iter_batches(batch_size=rows):
        yield [json.dumps(_plain(r), ensure_ascii=False, allow_nan=False) for r in batch.to_pylist()]
)PY";

}  // namespace

void for_each_parquet_row(const std::string& path, const std::function<bool(int64_t, const std::string&)>& row) {
  start();
  Gil gil;
  const auto fail = [&](const std::string& what) {
    throw ConfigError(fmt::format("{}: cannot read the parquet file: {}", path, what));
  };
  std::string error;
  Ref module = module_from_source("_tiller_parquet", kReaderSource, error);
  if (!module) fail(error);
  Ref it(PyObject_CallMethod(module.get(), "batches", "sL", path.c_str(), static_cast<long long>(kParquetBatchRows)));
  if (!it) fail(take_error());
  int64_t number = 0;
  for (;;) {
    Ref batch(PyIter_Next(it.get()));
    if (!batch) {
      if (PyErr_Occurred()) fail(take_error());
      return;
    }
    const Py_ssize_t n = PyList_Size(batch.get());
    for (Py_ssize_t i = 0; i < n; ++i) {
      const std::string text = utf8(PyList_GetItem(batch.get(), i));  // borrowed
      if (!row(++number, text)) return;
    }
  }
}

#else

void for_each_parquet_row(const std::string& path, const std::function<bool(int64_t, const std::string&)>&) {
  try {
    start();
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: cannot read a parquet file: {}", path, e.what()));
  }
}

#endif

}  // namespace tiller::python
