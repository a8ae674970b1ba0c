"""Parquet files edited the way a hand edit or a foreign writer would."""


def set_column(path, name, values) -> None:
    """Rewrite column `name` of the Parquet file at `path` with `values`, in the column's own type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    i = table.schema.get_field_index(name)
    pq.write_table(table.set_column(i, name, pa.array(values, table.schema.field(name).type)), path)
