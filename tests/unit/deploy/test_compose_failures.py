"""deploy/compose.py without an engine: which service a failed `up` is blamed on."""

from deploy.compose import failed_services


def test_the_failed_service_the_others_depend_on_is_named_first():
    """A database that refuses its volume (an older PostgreSQL) takes the MLflow server down with it; the
    container list may name MLflow first (measured on the real engine), but the line must say why the database
    stopped."""
    states = {
        "mlflow": {"Status": "exited"},
        "worker": {"Status": "running", "Running": True},
        "prefect-server": {"Status": "running", "Health": {"Status": "unhealthy"}},
        "db": {"Status": "exited"},
    }
    assert failed_services(states) == ["db", "mlflow", "prefect-server"]
    assert failed_services({"worker": {"Status": "running"}, "db": {"Status": "running"}}) == []
