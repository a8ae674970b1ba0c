"""Hand-written telemetry logs for the import tests."""


def write_log(path, text):
    """`text` (a log, its leading newlines dropped) written to `path`; returns `path`."""
    path.write_text(text.lstrip("\n"))
    return path


def gpu_rows(table):
    """An imported trace as a DataFrame in (gpu, time) order."""
    return table.to_pandas().sort_values(["gpu", "time"]).reset_index(drop=True)
