"""The HTTP contract with real SGLang releases (the pinned one and the oldest supported), read from their wheels:
every request the gateway sends to an engine, and every request the reference engine serves, uses routes, methods,
fields and sampling keys that the release declares (docs/sglang_api.md; docs/engine.md, "SGLang versions")."""

import copy

from services.receiver.stream import ipc_request
from tests.contract.gateway_calls import record, routes_in_code
from tests.contract.reference_engine import sampling_keys, served
from tests.contract.sglang_release import problems

ROUTER_ROUTES = {"/workers", "/workers/{}"}  # sglang-router's own (a Rust binary: docs/sglang_api.md)
RECEIVER_ROUTES = {"/receive_weights"}  # the weight receiver's own (services/receiver), beside each engine
# What the oldest supported release lacks of what our code uses; docs/engine.md lists the same.
NOT_IN_OLDEST = {
    "/begin_weight_update": "weight-update sessions (0.5.21): the gateway opens them only on 0.5.21+ engines",
    "/end_weight_update": "weight-update sessions (0.5.21): the gateway opens them only on 0.5.21+ engines",
    "beam_width": "a sampling key the reference engine takes at its default only; the gateway never sends it",
}
# The reference engine's own fields, which SGLang lacks: the gateway sends them only to engines that offer them.
EXTENSIONS = {
    "/update_weights_from_distributed": {"sequence"},  # ordered weight buckets, offered in /server_info
}


def lacking(release, pinned) -> set[str]:
    return set() if release.version == pinned.version else set(NOT_IN_OLDEST)


def test_every_request_the_gateway_sends_is_one_the_release_takes(release):
    """Routes, methods, fields (none unknown, none required missing) and sampling keys of every request the gateway's
    code sends: admission, health, generation with every sampling setting, pause, memory and weight syncs."""
    sent = record(release.version)
    found = [p for call in sent for p in problems(release, call.method, call.path, call.body)]
    assert not found, "\n".join(found)
    sessions = {"/begin_weight_update", "/end_weight_update"} <= {c.path for c in sent}
    assert sessions == (_numbers(release.version) >= (0, 5, 21)), "sessions go to 0.5.21+ engines, and only there"


def test_every_route_the_gateway_names_is_driven_here_and_served_by_the_release(release, pinned):
    """A route named in the gateway's modules that the recorded flows never reach is a call gateway_calls.py must
    drive; each one is the release's, except what the oldest lacks and the gateway knows it lacks."""
    named = set(routes_in_code()) - ROUTER_ROUTES - RECEIVER_ROUTES
    assert named == {c.path for c in record(pinned.version)}, "drive the new call in tests/contract/gateway_calls.py"
    assert named - set(release.routes) == lacking(release, pinned) & named


def test_the_reference_engine_serves_only_what_the_release_declares(release, pinned):
    """Its routes and methods are the release's, each handler reads only fields of the release's request structure,
    and its sampling keys are the release's (it implements the pinned release: the oldest lacks a few)."""
    found = []
    for path, (methods, fields) in served().items():
        if path in lacking(release, pinned):
            continue
        for method in sorted(methods):
            found += problems(release, method, path, dict.fromkeys(set(fields) - EXTENSIONS.get(path, set())),
                              required=False)  # fmt: skip
    assert not found, "\n".join(found)
    assert sampling_keys() - release.sampling_keys == lacking(release, pinned) & sampling_keys()
    assert lacking(release, pinned) <= set(served()) | sampling_keys() | set(routes_in_code())  # not stale


def test_a_renamed_or_missing_field_is_reported(pinned):
    """What the tests above would say had one of our requests a field renamed: the field SGLang would silently
    ignore, the required one it misses, an unknown sampling key, a route or method it does not serve."""
    sent = {c.path: c.body for c in record(pinned.version) if c.method == "POST"}
    at = f"(sglang {pinned.version})"
    init = copy.deepcopy(sent["/init_weights_update_group"])
    init["master_prt"] = init.pop("master_port")
    assert problems(pinned, "POST", "/init_weights_update_group", init) == [
        f"POST /init_weights_update_group {at}: InitWeightsUpdateGroupReqInput has no field 'master_prt' "
        "(did you mean 'master_port'?)",
        f"POST /init_weights_update_group {at}: InitWeightsUpdateGroupReqInput requires 'master_port'",
    ]
    update = copy.deepcopy(sent["/update_weights_from_distributed"])
    update["group"] = update.pop("group_name")  # has a default: SGLang would load into the default group's name
    assert problems(pinned, "POST", "/update_weights_from_distributed", update) == [
        f"POST /update_weights_from_distributed {at}: UpdateWeightsFromDistributedReqInput has no field "
        "'group' (did you mean 'group_name'?)"
    ]
    generate = copy.deepcopy(sent["/generate"])
    generate["sampling_params"]["max_tokens"] = generate["sampling_params"].pop("max_new_tokens")
    assert problems(pinned, "POST", "/generate", generate) == [
        f"POST /generate {at}: sampling_params has no key 'max_tokens' (did you mean 'max_new_tokens'?)"
    ]
    assert problems(pinned, "POST", "/update_weight_versions", {}) == [
        f"POST /update_weight_versions {at}: no such route in sglang/srt/entrypoints/http_server.py"
    ]
    assert problems(pinned, "GET", "/pause_generation") == [f"GET /pause_generation {at}: the route takes ['POST']"]


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_receivers_call_is_one_the_pinned_release_takes(pinned):
    """The weight receiver beside an engine feeds it through /update_weights_from_ipc (0.5.23): its request's fields
    are the release's own, and the release declares the route."""
    body = ipc_request({"GPU-00000000-0000-0000-0000-000000000000": "ipc://@x"}, False, "3")
    assert not problems(pinned, "POST", "/update_weights_from_ipc", body)
