"""Test-wide setup: 8 virtual CPU devices, set before any JAX backend starts; the PostgreSQL server."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu, where installed, starts quietly
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # the tests and the commands they start both compile

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from tests import pg  # noqa: E402


@pytest.fixture(scope="session")
def pg_url():
    """The PostgreSQL URL of this test session: CMTUNE_TEST_DATABASE_URL's server (CI's) when set, else an
    embedded one started on first use and removed at the end (tests/pg.py); a skip saying what to install
    only where neither can be had."""
    if url := os.environ.get(pg.ENV):
        yield url
        return
    try:
        server = pg.EmbeddedPostgres.start()
    except pg.Unavailable as reason:
        pytest.skip(str(reason))
    yield server.url
    server.stop()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``tpu_aot`` compile for TPU topologies, ``gpu_aot`` for GPU nodes: they skip, saying what to
    install, where libtpu or JAX's CUDA plugin is not installed (CI installs both and fails on a skip)."""
    import importlib.util

    missing = {}
    if importlib.util.find_spec("libtpu") is None:
        missing["tpu_aot"] = "no libtpu: pip install 'cmtune[tpu]' (JAX's TPU build) to compile for TPU topologies"
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        missing["gpu_aot"] = "no JAX CUDA plugin: pip install 'cmtune[gpu]' to compile for GPU nodes"
    for item in items:
        for marker, reason in missing.items():
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
