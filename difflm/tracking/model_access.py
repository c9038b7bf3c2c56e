"""Who may write to a registered model, as the MLflow server records it (its basic-auth app's permissions): the
registry trusts a model name, for loading its versions, promoting and registering into it, only when the pipeline
user holds MANAGE on it (it created the name, or was granted it) and nobody outside the pipeline user and
`tracking.trusted_registrants` holds EDIT or MANAGE (an MLflow admin holds everything). A version's own tags cannot
decide this: whoever can write a version writes its tags too.

A store without accounts (a local file or sqlite store, a server without the auth app) records no permissions:
`check_model` says so (False) and the caller falls back to the registrant tag (registry.check_owner).
"""

from __future__ import annotations

from difflm.config import TrackingConfig
from difflm.errors import UserError

CURRENT_USER, LIST_USERS = "/api/2.0/mlflow/users/current", "/api/2.0/mlflow/users/list"
USER_PERMISSION = "/api/3.0/mlflow/users/permissions/get"
# the permissions that allow writing versions, tags and aliases (mlflow.server.auth.permissions: can_update);
# named here because importing that module starts loading MLflow's Flask server
WRITERS = ("EDIT", "MANAGE")


class UntrustedModel(UserError):
    """A registered model that someone outside the pipeline user and tracking.trusted_registrants may write to,
    or that the pipeline user does not manage."""


def _get(uri: str, endpoint: str, params: dict | None = None):
    """GET `endpoint` of the server at `uri` with this process's MLflow credentials (the response, any status)."""
    # mlflow takes seconds to import: loaded only when a server is asked
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    return http_request(get_default_host_creds(uri), endpoint, "GET", params=params)


def _answer(resp, uri: str, what: str, asking: str) -> dict:
    """The JSON of a 200 response; UntrustedModel naming what could not be read otherwise."""
    if resp.status_code == 200:
        return resp.json()
    raise UntrustedModel(
        f"{what}: refused, nothing of it was used: the server {uri} did not let {asking} (HTTP {resp.status_code}), "
        f"so who may write to it cannot be checked; run as an MLflow admin (the stack's `admin`) or as the "
        f"pipeline user with admin rights"
    )


def check_model(uri: str, name: str, t: TrackingConfig, what: str) -> bool:
    """True when the server at `uri` records who may write to registered model `name` and they are all trusted;
    False when it records no permissions (not a server, or one without accounts); UntrustedModel otherwise.
    `what` starts the refusal ("registering into ...", "models:/NAME@champion ...")."""
    if not uri.startswith(("http://", "https://")):
        return False
    current = _get(uri, CURRENT_USER)
    if current.status_code == 404:  # no auth app: every client may write everything, nothing is recorded
        return False
    me = t.pipeline_user or _answer(current, uri, what, "this client read its own user")["user"]["username"]
    trusted = {me, *t.trusted_registrants}
    users = _answer(_get(uri, LIST_USERS), uri, what, "this client list its users")["users"]

    def permission(user: str) -> str:
        params = {"username": user, "resource_type": "registered_model", "resource_id": name}
        return _answer(_get(uri, USER_PERMISSION, params), uri, what, f"this client read {user}'s permissions")[
            "permission"
        ]

    held = permission(me)
    if held != "MANAGE":
        raise UntrustedModel(
            f"{what}: refused: registered model {name!r} was not created by the pipeline user {me!r} (it holds "
            f"{held} on it, not MANAGE; {_writers(users, trusted, permission) or 'someone else'} created or "
            f"manages it). Set tracking.registered_model to a name the pipeline creates, or have an MLflow admin "
            f"grant {me!r} MANAGE on it after checking its versions"
        )
    others = _writers(users, trusted, permission)
    if others:
        raise UntrustedModel(
            f"{what}: refused, nothing of it was used: registered model {name!r} is not the pipeline user's "
            f"alone: {others} may also write to it (the server's permissions decide, not the versions' tags). "
            f"Revoke that (an MLflow admin: users/permissions/revoke), or if you trust them add them to "
            f"tracking.trusted_registrants"
        )
    return True


def _writers(users: list[dict], trusted: set[str], permission) -> str:
    """'NAME (EDIT), ...': the users outside `trusted` who may write to the model (an admin may write anything)."""
    found = []
    for user in users:
        if user["username"] in trusted:
            continue
        held = "admin" if user.get("is_admin") else permission(user["username"])
        if held == "admin" or held in WRITERS:
            found.append(f"{user['username']} ({held})")
    return ", ".join(found)
