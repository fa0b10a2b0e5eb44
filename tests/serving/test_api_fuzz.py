"""A bounded schema-driven fuzz of a real server, through ``bench/api_fuzz.py``'s driver (its long
run is that script): requests drawn by schemathesis from the frontend's own ``/openapi.json``,
valid and invalid, on every route, each answer held to the document (a listed status, in its
content type, with its family's body; never a 500, a traceback or a server path). Afterwards the
server is idle and answers as it did before. A server of its own: its output limit keeps the
generated requests short, and its idle state is its own."""

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from tests.serving.conftest import wait_idle

pytestmark = [pytest.mark.server, pytest.mark.model]

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("api_fuzz", BENCH / "api_fuzz.py")
api_fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(api_fuzz)

EXAMPLES = 100  # per operation, derandomized: the same requests every run


@pytest.fixture(scope="module")
def fuzzed(smollm2_dir, tmp_path_factory):
    with api_fuzz.serving(str(smollm2_dir), tmp_path_factory.mktemp("fuzz")) as (server, frontend):
        yield server, frontend


def test_generated_requests_get_documented_answers_and_leave_the_server_as_it_was(fuzzed):
    server, frontend = fuzzed
    before = api_fuzz.generate(frontend)
    answered = Counter()
    api_fuzz.fuzz(frontend.url, EXAMPLES, on_answer=lambda operation, status: answered.update([status]))
    # about 400 requests, a few dozen of them through the engine
    assert sum(answered.values()) >= 3 * EXAMPLES and answered[200] >= 10 and answered[400] >= EXAMPLES, answered
    idle = wait_idle(server)
    assert all(idle[name] == 0 for name in api_fuzz.LEAKS), {name: idle[name] for name in api_fuzz.LEAKS}
    assert api_fuzz.generate(frontend) == before
