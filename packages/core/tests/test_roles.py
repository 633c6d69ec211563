"""Served roles (config/roles.py, core/roles/): the config section, its place in the placement plan, the refusals
that name the field, the key kept out of every printed config, the client's retries and errors, the reward
model's batches, and the teacher's tokenizer check."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.roles.client import RoleClient, RoleError
from slime_rl.core.roles.endpoints import ENV_ROLES_FILE, Endpoint, role_client, write_endpoints
from slime_rl.core.roles.reward_model import RewardModelReward
from slime_rl.core.roles.teacher import reverse_kl_metrics, tokenizer_mismatch
from slime_rl.core.sample import Sample

KEY = "sk-role-key-0123456789abcdef"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "1+1=", "label": "2"}\n')
    return path


def cfg_with(prompts, tmp_path, roles: str, *more: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    return load_config(None, [f"data.prompt_data={prompts}", f"roles={roles}", *more], check=True)


def test_roles_take_their_own_gpus_after_the_rollout_or_share_the_engines(prompts, tmp_path):
    folder = tmp_path / "m"
    cfg = cfg_with(prompts, tmp_path, f"{{teacher: {{kind: teacher, path: {folder}, num_gpus: 2}},"
                   f" rm: {{kind: reward_model, path: {folder}, colocate: true}}}}",
                   "cluster.colocate=false", "cluster.rollout_num_gpus=2", "algorithm.advantage_estimator=opd")
    plan = plan_placement(cfg, device="cuda")
    assert [b.index for b in plan.bundles] == list(range(5))  # trainer 0, rollout 1-2, teacher 3-4
    teacher, rm = plan.roles
    assert (teacher.bundles, teacher.colocated, rm.bundles, rm.colocated) == ((3, 4), False, (1,), True)
    text = plan.format()
    assert "role teacher (teacher, engine hf, frozen): gpus 3 (node 0, gpu 3), 4 (node 0, gpu 4), its own" in text
    assert "role rm (reward_model, engine hf, frozen): gpus 1 (node 0, gpu 1), shared with the rollout engines" in text


def test_a_role_that_would_span_nodes_is_refused(prompts, tmp_path):
    with pytest.raises(ConfigError, match=r"roles\.judge\.num_gpus: the role would span nodes \[1, 2\]"):
        cfg_with(prompts, tmp_path, f"{{judge: {{kind: judge, path: {tmp_path / 'm'}, num_gpus: 2}}}}",
                 "cluster.num_gpus_per_node=2", "cluster.colocate=false", "cluster.rollout_num_gpus=2")


@pytest.mark.parametrize(("roles", "more", "message"), [
    ("{}", ["algorithm.advantage_estimator=opd"],
     r"roles: algorithm.advantage_estimator=opd needs a role of kind teacher"),
    ("{}", ["rollout.reward=reward_model"], r"roles: rollout.reward=reward_model needs a role of kind reward_model"),
    ("{a: {kind: teacher, path: M}, b: {kind: teacher, path: M}}", ["algorithm.advantage_estimator=opd"],
     r"uses the one role of kind teacher, but there are 2 \(a, b\)"),
    ("{judge: {kind: judge, path: /nowhere}}", [], r"roles\.judge\.path: /nowhere is not a folder"),
    ("{bad-name: {kind: judge, path: M}}", [], r"roles\.bad-name: a role's name takes letters, digits and '_'"),
])
def test_a_config_that_misses_or_misnames_a_role_is_refused_naming_the_field(prompts, tmp_path, roles, more, message):
    with pytest.raises(ConfigError, match=message):
        cfg_with(prompts, tmp_path, roles.replace("M", str(tmp_path / "m")), *more)


def test_a_roles_key_is_redacted_wherever_the_config_is_printed(prompts, tmp_path):
    cfg = cfg_with(prompts, tmp_path, f"{{judge: {{kind: judge, path: {tmp_path / 'm'}, api_key: {KEY}}}}}")
    assert KEY not in cfg.to_yaml() and KEY not in json.dumps(cfg.to_dict())
    assert cfg.to_dict(reveal_secrets=True)["roles"]["judge"]["api_key"] == KEY


def test_the_endpoint_never_shows_its_key_or_url(tmp_path, monkeypatch):
    endpoint = Endpoint("judge", "judge", "http://127.0.0.1:9/x", KEY, 1.0, 1, 8, 16)
    write_endpoints(tmp_path / "roles.json", {"judge": endpoint})
    assert (tmp_path / "roles.json").stat().st_mode & 0o077 == 0
    monkeypatch.setenv(ENV_ROLES_FILE, str(tmp_path / "roles.json"))
    client = role_client()  # the one judge
    assert KEY not in repr(client) + repr(endpoint) and "9/x" not in repr(client)
    with pytest.raises(LookupError, match="the run serves no role 'teacher'; it serves judge"):
        role_client("teacher")


class _Scripted(BaseHTTPRequestHandler):
    """Answers each POST with the next (status, body) of the server's script; records what came."""

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 - /health only
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.seen.append((self.path, body, self.headers.get("Authorization")))
        status, reply = self.server.script.pop(0) if self.server.script else (200, {})
        if callable(reply):  # a reply made from the request (concurrent requests arrive in any order)
            reply = reply(body)
        if status == "hang":
            threading.Event().wait(1.0)
            status, reply = 200, {}
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def scripted():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.script, server.seen = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def client_of(server, **kw) -> RoleClient:
    return RoleClient("judge", f"http://127.0.0.1:{server.server_address[1]}", KEY, backoff_s=0.01, **kw)


def test_the_client_retries_busy_and_failing_servers_then_answers(scripted):
    scripted.script = [(503, {"error": "busy"}), (429, {}), (200, {"text": "yes"})]
    assert asyncio.run(client_of(scripted).generate("Is 2 right?", max_new_tokens=3)) == "yes"
    assert [auth for _, _, auth in scripted.seen] == [f"Bearer {KEY}"] * 3
    assert scripted.seen[-1][1] == {"text": "Is 2 right?", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}


def test_a_refused_request_is_not_retried_and_the_error_keeps_the_key_out(scripted):
    scripted.script = [(401, {"error": f"bad key {KEY}"})]
    with pytest.raises(RoleError) as err:
        asyncio.run(client_of(scripted).generate("q"))
    assert "refused the request: HTTP 401" in str(err.value) and KEY not in str(err.value)
    assert len(scripted.seen) == 1


def test_a_server_slower_than_the_timeout_fails_after_every_attempt(scripted):
    scripted.script = [("hang", None)] * 2
    with pytest.raises(RoleError, match=r"no answer after 2 tries; last: no answer within 0.2 s"):
        asyncio.run(client_of(scripted, timeout_s=0.2, attempts=2).generate("q"))


def test_prefill_takes_each_sequences_response_log_probs(scripted):
    scripted.script = [(200, [{"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.5, 6, None], [-1.5, 7, None]]}},
                              {"meta_info": {"input_token_logprobs": [[None, 5, None], [-2.0, 9, None]]}}])]
    rows = asyncio.run(client_of(scripted).prefill_log_probs([[5, 6, 7], [5, 9]], [2, 1]))
    assert rows == [[-0.5, -1.5], [-2.0]]
    _, body, _ = scripted.seen[0]
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["logprob_start_len"] == 0


def test_the_reward_model_scores_a_wave_of_calls_in_batches(scripted):
    def scores(body):  # "p<i> r<i>" scores i
        return [{"embedding": [float(text.split()[0][1:])]} for text in body["text"]]

    scripted.script = [(200, scores), (200, scores)]
    reward = RewardModelReward(client_of(scripted), batch_size=3)
    samples = [Sample(index=i, prompt=f"p{i} ", response=f"r{i}") for i in range(5)]

    async def wave():
        return await asyncio.gather(*(reward(s) for s in samples))

    assert asyncio.run(wave()) == [0.0, 1.0, 2.0, 3.0, 4.0]  # each sample gets its own score back
    assert sorted(len(body["text"]) for path, body, _ in scripted.seen) == [2, 3]
    assert {path for path, _, _ in scripted.seen} == {"/classify"}
    assert sorted(t for _, body, _ in scripted.seen for t in body["text"]) == [f"p{i} r{i}" for i in range(5)]


def test_a_failed_classify_fails_every_sample_of_its_request(scripted):
    scripted.script = [(400, {"error": "no"})]
    reward = RewardModelReward(client_of(scripted), batch_size=8)

    async def wave():
        return await asyncio.gather(*(reward(Sample(index=i, response="r")) for i in range(2)), return_exceptions=True)

    results = asyncio.run(wave())
    assert all(isinstance(r, RoleError) for r in results)


class _Tok:
    def __init__(self, vocab, eos=0):
        self.vocab, self.eos_token_id, self.bos_token_id, self.pad_token_id = vocab, eos, None, eos

    def get_vocab(self):
        return dict(self.vocab)


def test_the_tokenizer_check_names_what_differs():
    same = {"a": 0, "b": 1}
    assert tokenizer_mismatch(_Tok(same), _Tok(same)) is None
    assert "the vocabularies differ in 1 tokens ('b': 1 vs 2" in tokenizer_mismatch(_Tok(same), _Tok({"a": 0, "b": 2}))
    assert "eos_token_id is 0 for the student, 1 for the teacher" in tokenizer_mismatch(_Tok(same), _Tok(same, eos=1))


def test_the_reverse_kl_metric_is_the_mean_over_trained_tokens():
    samples = [Sample(index=0, response_length=2, loss_mask=[1, 0], rollout_log_probs=[-1.0, -5.0]),
               Sample(index=1, response_length=1, loss_mask=[1], rollout_log_probs=[-0.5])]
    metrics = reverse_kl_metrics(samples, [[-2.0, -0.1], [-1.5]])
    assert metrics["opd/reverse_kl"] == pytest.approx(1.0) and metrics["opd/teacher_tokens"] == 2.0


@pytest.mark.parametrize("value", ["true", ".inf", "2.5"])
def test_a_roles_numbers_are_strict(prompts, tmp_path, value):
    field = "attempts" if value == "2.5" else "timeout_s"
    with pytest.raises(ConfigError, match=r"roles"):
        cfg_with(prompts, tmp_path, f"{{judge: {{kind: judge, path: {tmp_path / 'm'}, {field}: {value}}}}}")


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _FakeRoleWorker:
    """A role actor whose server stops answering once; `restart` brings up one at ``new_url``."""

    def __init__(self, new_url):
        self.alive, self.restarts = True, 0
        self.healthy = _Remote(lambda: self.alive)

        def restart():
            self.restarts += 1
            self.alive = True
            return new_url

        self.restart = _Remote(restart)


class _Watch:
    def get(self, phase, refs, handles):
        return list(refs)


def test_a_role_that_stops_answering_is_restarted_then_the_run_fails_past_max_restarts(tmp_path, prompts, scripted):
    from slime_rl.core.config import RunFailedError
    from slime_rl.core.roles.endpoints import read_endpoints
    from slime_rl.core.run.role_workers import Roles

    url = f"http://127.0.0.1:{scripted.server_address[1]}"
    cfg = cfg_with(prompts, tmp_path, f"{{judge: {{kind: judge, path: {tmp_path / 'm'}, max_restarts: 1}}}}")
    roles = Roles.__new__(Roles)  # the driver's handle without Ray: one fake actor
    worker = _FakeRoleWorker(url)
    roles.cfg, roles.watch, roles.endpoints_file = cfg, _Watch(), tmp_path / "roles.json"
    roles.keys, roles.workers, roles.restarts, roles.last_check = {"judge": KEY}, {"judge": worker}, {"judge": 0}, 0.0
    roles.urls = {"judge": url}
    assert roles.check(force=True) == []  # answers: nothing to do
    worker.alive = False
    assert roles.check(force=True) == ["role judge stopped answering; restarted (1 of 1)"]
    assert worker.restarts == 1 and read_endpoints(tmp_path / "roles.json")["judge"].url == url
    assert roles.check() == []  # within health_interval_s: not checked again yet
    worker.alive = False
    with pytest.raises(RunFailedError, match=r"roles\.judge\.max_restarts: the judge role stopped answering 2 times"):
        roles.check(force=True)


def test_a_role_whose_process_died_gets_a_new_actor(tmp_path, prompts, scripted):
    from slime_rl.core.run.role_workers import Roles

    url = f"http://127.0.0.1:{scripted.server_address[1]}"
    cfg = cfg_with(prompts, tmp_path, f"{{judge: {{kind: judge, path: {tmp_path / 'm'}}}}}")

    def died():
        raise RuntimeError("the actor died")

    dead, fresh = _FakeRoleWorker(url), _FakeRoleWorker(url)
    dead.healthy = _Remote(died)
    fresh.ready = _Remote(lambda: url)
    roles = Roles.__new__(Roles)
    roles.cfg, roles.watch, roles.endpoints_file = cfg, _Watch(), tmp_path / "roles.json"
    roles.keys, roles.workers, roles.restarts, roles.last_check = {"judge": KEY}, {"judge": dead}, {"judge": 0}, 0.0
    roles.urls = {"judge": url}
    roles._spawn = lambda name: fresh
    assert roles.check(force=True) == ["role judge stopped answering; restarted (1 of 3)"]
    assert roles.workers["judge"] is fresh and dead.restarts == 0
