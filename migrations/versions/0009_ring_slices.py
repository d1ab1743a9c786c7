"""rings on part of a slice: the hardware of a ring records the devices of the slice it is part of

- hardware.slice_devices: where the ring is part of a larger slice (tensor parallelism 8 on a v5p-64), the
  slice's devices; device_count and process_count stay the ring's (`collective_matmul.planning.problem.Hardware`).  Its
  key then names the slice (``cpu:cpu:4:1/8``: a ring of 4 devices of an 8-device slice), because a ring that
  runs beside the slice's other rings is not the hardware of a machine of its size.  NULL: the ring is the
  whole machine, as every row before this revision is (their keys stay as they are).  Rows whose key names a
  slice (written by this revision, then downgraded) get it back from the key.

Downgrading drops the column: rows of rings of part of a slice keep their keys, which the older code never
asks for, so their studies and configs lie unused until the next upgrade restores them.

Revision ID: 0009
Revises: 0008
"""

import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


_hardware = sa.table("hardware", sa.column("id", sa.Integer()), sa.column("key", sa.String(300)),
                     sa.column("slice_devices", sa.Integer()))
_SLICE = re.compile(r":\d+:\d+/(\d+)$")  # `Hardware.key` of a ring of part of a slice: ...:RING:PROCESSES/SLICE


def upgrade() -> None:
    with op.batch_alter_table("hardware") as batch:
        batch.add_column(sa.Column("slice_devices", sa.Integer(), nullable=True))
    bind = op.get_bind()
    for row in bind.execute(sa.select(_hardware.c.id, _hardware.c.key).where(_hardware.c.key.like("%/%"))).all():
        if found := _SLICE.search(row.key):
            bind.execute(_hardware.update().where(_hardware.c.id == row.id).values(slice_devices=int(found[1])))


def downgrade() -> None:
    with op.batch_alter_table("hardware") as batch:
        batch.drop_column("slice_devices")
