"""Alembic environment: runs against the connection that `cmtune.service.migrate` hands in.

The service passes its models' metadata in ``config.attributes`` (used by autogenerate), so the
migrations import nothing of the service: revisions describe the schema in plain Alembic ops.
"""

from alembic import context
from sqlalchemy import create_engine

config = context.config
target_metadata = config.attributes.get("target_metadata")


def run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (connection := config.attributes.get("connection")) is not None:
    run(connection)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        run(conn)
    engine.dispose()
