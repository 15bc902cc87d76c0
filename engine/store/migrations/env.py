"""Alembic environment: migrate the connection tokenflow hands over, or open one from `-x db=`."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from engine.store.models import Base

config = context.config


def run_migrations(connection: object) -> None:
    # Batch mode lets later revisions alter tables, which SQLite's ALTER cannot do in place.
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True,
                      transaction_per_migration=True, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    from engine.store.database import migration_connection, open_database

    if config.config_file_name is not None:
        fileConfig(config.config_file_name)
    database = open_database(context.get_x_argument(as_dictionary=True).get("db"), upgrade=False)
    try:
        with migration_connection(database) as own_connection:
            run_migrations(own_connection)
    finally:
        database.close()
