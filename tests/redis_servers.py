"""`redis_url` on both servers, for the tests whose subject is Redis's state: each runs on the embedded server and on
a real redis:7 container (testcontainers). A test module or conftest opts in with
`from tests.redis_servers import redis_url_on_both  # noqa: F401`."""

import pytest


@pytest.fixture(scope="session", params=["embedded", "redis:7"], name="redis_url")
def redis_url_on_both(request) -> str:
    return request.getfixturevalue("embedded_redis_url" if request.param == "embedded" else "container_redis_url")
