"""Alembic environment and versions for the service's tables (see service/migrate.py)."""
