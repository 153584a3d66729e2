"""The stable `replicate` Python client (1.0.x) against `hangar serve`.

Run by tests/replicate_python.rs with REPLICATE_BASE_URL and
REPLICATE_API_TOKEN set; exits non-zero on the first failed check.
"""

import os
import sys
import time

import httpx
import replicate
from replicate.exceptions import ReplicateError

FAST, SLOW = "t/fast", "t/slow"


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")
    print(f"ok: {what}")


# replicate.run on the model route, waiting (Prefer: wait).
out = replicate.run(FAST, input={"prompt": "Hello", "max_tokens": 5})
tokens = list(out)
check(len(tokens) == 5 and all(isinstance(t, str) for t in tokens), f"run returns 5 tokens: {tokens}")

# The version route: the schema says the output is an iterator.
model = replicate.models.get(FAST)
version = model.latest_version
check(version is not None and len(version.id) == 64, "models.get has a latest version")
check(version.openapi_schema["components"]["schemas"]["Input"]["required"] == ["prompt"], "openapi_schema")
out = replicate.run(f"{FAST}:{version.id}", input={"prompt": "Hi", "max_new_tokens": 3})
check(len(list(out)) == 3, "run on owner/name:version")

# What the client lists: models, deployments, hardware.
listed = replicate.models.list()
check({m.id for m in listed.results} >= {FAST, SLOW}, f"models.list: {[m.id for m in listed.results]}")
deployment = replicate.deployments.get("acme/fast-prod")
release = deployment.current_release
check(release.model == FAST and release.configuration.hardware == "gpu", "deployments.get: model, hardware")
check((release.configuration.min_instances, release.configuration.max_instances) == (1, 1), "deployments.get: bounds")
check(not release.created_at.startswith("1970"), f"deployments.get: created_at {release.created_at}")
check([d.name for d in replicate.deployments.list().results] == ["fast-prod"], "deployments.list")
check([h.sku for h in replicate.hardware.list()] == ["gpu"], "hardware.list")

# Deployments made, run, changed and deleted through the client: each sets
# its model's replica bounds (t/slow's own are 1 to 1).
slow_version = replicate.models.get(SLOW).latest_version.id
made = replicate.deployments.create(
    name="slow-live", model=SLOW, version=slow_version, hardware="gpu", min_instances=1, max_instances=2
)
release = made.current_release
check(made.owner == "compat" and made.name == "slow-live", f"deployments.create: {made.owner}/{made.name}")
check(release.number == 1 and release.created_by.username == "compat", "deployments.create: release 1 by compat")
check((release.configuration.min_instances, release.configuration.max_instances) == (1, 2), "deployments.create: bounds")
check(
    [d.name for d in replicate.deployments.list().results] == ["fast-prod", "slow-live"],
    "deployments.list shows the made one",
)
changed = replicate.deployments.update(deployment_owner="compat", deployment_name="slow-live", max_instances=1)
check(changed.current_release.number == 2, "deployments.update: release 2")
check(changed.current_release.configuration.max_instances == 1, "deployments.update: max_instances")
p = replicate.deployments.get("compat/slow-live").predictions.create(input={"prompt": "x", "max_tokens": 2})
p.wait()
check(p.status == "succeeded" and len(p.output) == 2, f"a prediction through the made deployment: {p.status}")
try:
    replicate.deployments.create(
        name="again", model=SLOW, version=slow_version, hardware="gpu", min_instances=0, max_instances=1
    )
    check(False, "a second deployment of a model is refused")
except ReplicateError as e:
    check(e.status == 409 and "compat/slow-live" in str(e.detail), f"second deployment refused: {e}")
try:
    replicate.deployments.update(deployment_owner="acme", deployment_name="fast-prod", min_instances=2)
    check(False, "a declared deployment is not changed through the API")
except ReplicateError as e:
    check(e.status == 409 and "predictions.deployments" in str(e.detail), f"declared one refused: {e}")
check(replicate.deployments.delete("compat", "slow-live"), "deployments.delete")
check([d.name for d in replicate.deployments.list().results] == ["fast-prod"], "deleted")

# predictions.create / get / wait / list.
p = replicate.predictions.create(version=version.id, input={"prompt": "x", "max_tokens": 4})
check(p.status == "starting", f"created: {p.status}")
p.wait()
check(p.status == "succeeded" and len(p.output) == 4, f"waited: {p.status} {p.output}")
again = replicate.predictions.get(p.id)
check(again.id == p.id and again.output == p.output, "predictions.get")
page = replicate.predictions.list()
check(any(r.id == p.id for r in page.results), "predictions.list")

# Cancel a running prediction.
long = replicate.models.predictions.create(model=SLOW, input={"prompt": "x", "max_tokens": 100000})
deadline = time.time() + 20
while long.status != "processing" and time.time() < deadline:
    time.sleep(0.05)
    long.reload()
check(long.status == "processing", "the long prediction runs")
replicate.predictions.cancel(long.id)
long.reload()
check(long.status == "canceled", f"canceled: {long.status}")

# stream(): output events then done.
events = list(replicate.stream(FAST, input={"prompt": "x", "max_tokens": 6}))
outputs = [str(e) for e in events if e.event.value == "output"]
check(len(outputs) == 6, f"stream gives 6 outputs: {outputs}")
check(events[-1].event.value == "done", "stream ends with done")

# An aborted prediction (its Cancel-After passed while it waited behind a
# long one) does not crash the client: it reads as canceled.
base = os.environ["REPLICATE_BASE_URL"]
token = os.environ["REPLICATE_API_TOKEN"]
auth = {"Authorization": f"Bearer {token}"}
blocker = replicate.models.predictions.create(model=SLOW, input={"prompt": "x", "max_tokens": 100000})
r = httpx.post(
    f"{base}/v1/models/{SLOW}/predictions",
    json={"input": {"prompt": "x"}},
    headers={**auth, "Cancel-After": "5s"},
)
check(r.status_code == 201, f"created with Cancel-After: {r.status_code} {r.text}")
doomed_id = r.json()["id"]
time.sleep(7)
doomed = replicate.predictions.get(doomed_id)
check(doomed.status == "canceled" and "Cancel-After" in (doomed.error or ""), f"aborted reads as canceled: {doomed.status}")
replicate.predictions.cancel(blocker.id)

# Errors surface as ReplicateError with the problem's detail.
try:
    replicate.models.predictions.create(model=FAST, input={"prompt": 5})
    check(False, "a bad input is refused")
except ReplicateError as e:
    check(e.status == 422 and "input.prompt" in str(e), f"422 names the field: {e}")
# The cog model of examples/cog-echo, served through the `cog` engine.
COG = "examples/cog-echo"
out = replicate.run(COG, input={"prompt": "hello cog", "repeat": 2})
check("".join(out) == "echo: hello cog hello cog ", f"run on a cog model: {out}")
events = list(replicate.stream(COG, input={"prompt": "a b c", "delay": 0.05}))
outputs = [str(e) for e in events if e.event.value == "output"]
check(outputs == ["echo: ", "a ", "b ", "c "], f"stream of a cog model's Iterator output: {outputs}")
p = replicate.models.predictions.create(model=COG, input={"prompt": "x " * 100, "delay": 0.2})
while p.status == "starting":
    time.sleep(0.05)
    p.reload()
replicate.predictions.cancel(p.id)
p.wait()
check(p.status == "canceled", f"cancel a running cog prediction: {p.status}")
print("all replicate checks passed")
