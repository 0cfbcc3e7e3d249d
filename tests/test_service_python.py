#!/usr/bin/python3
"""test_service_python.py - a client we did not write drives moetraind.

Debian's python3-grpcio, with stubs generated at test time from
api/moetrain.proto (and the gRPC health and reflection protos) by Debian's
grpc_tools, runs the whole flow: health, start, stream metrics (consecutive
steps, no duplicates), pause (the step stops), resume, save, list, stop with
a checkpoint, the token, server reflection (a descriptor pool built from
what the server sends, the way grpcurl does it); then a restarted daemon
starts the job from its checkpoint.

    test_service_python.py BUILD_DIR SOURCE_DIR SCRATCH_DIR
"""
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

BUILD, SOURCE, TMP = sys.argv[1:4]
GRPC_PROTO = "/usr/share/grpc-proto"
TOKEN = "python-token-0123456789abcdef"

shutil.rmtree(TMP, ignore_errors=True)
os.makedirs(TMP)
stubs = os.path.join(TMP, "stubs")
os.makedirs(stubs)
# The health and reflection protos are compiled from copies at the top
# level: under their own path grpc/... the stubs' package would shadow the
# grpc module itself. Their proto packages, so the wire names, are as is.
for src in ["grpc/health/v1/health.proto", "grpc/reflection/v1/reflection.proto"]:
    shutil.copy(os.path.join(GRPC_PROTO, src), stubs)
subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", os.path.join(SOURCE, "api"),
                "-I", stubs, "--python_out", stubs, "--grpc_python_out", stubs,
                "moetrain.proto", "health.proto", "reflection.proto"], check=True)
sys.path.insert(0, stubs)
import grpc  # noqa: E402  (Debian's python3-grpcio)
from google.protobuf import descriptor_pb2, descriptor_pool  # noqa: E402

pb = importlib.import_module("moetrain_pb2")
pb_grpc = importlib.import_module("moetrain_pb2_grpc")
hpb = importlib.import_module("health_pb2")
hpb_grpc = importlib.import_module("health_pb2_grpc")
rpb = importlib.import_module("reflection_pb2")
rpb_grpc = importlib.import_module("reflection_pb2_grpc")

subprocess.run([os.path.join(BUILD, "engine", "moetrain-data"), "synth", "--output",
                os.path.join(TMP, "data", "syn"), "--vocab", "64", "--tokens", "200000",
                "--seed", "5"], check=True, stdout=subprocess.DEVNULL)
with open(os.path.join(TMP, "token"), "w") as f:
    f.write(TOKEN + "\n")
os.chmod(os.path.join(TMP, "token"), 0o600)
with open(os.path.join(SOURCE, "deploy", "examples", "tiny-cpu.json")) as f:
    JOB = f.read()
SETS = ["data.path=" + os.path.join(TMP, "data", "syn"), "train.steps=100000",
        "batch.seq_len=32", "data.valid_interval=0", "train.log_interval=1000",
        "name=pyjob"]
AUTH = [("authorization", "Bearer " + TOKEN)]

checks = 0
daemons = []


def check(cond, what):
    global checks
    if not cond:
        print("FAIL:", what, file=sys.stderr)
        for d in daemons:
            d.kill()
        with open(os.path.join(TMP, "daemon.log")) as f:
            sys.stderr.write(f.read()[-3000:])
        sys.exit(1)
    checks += 1


def start_daemon():
    ready = os.path.join(TMP, "ready")
    if os.path.exists(ready):
        os.remove(ready)
    log = open(os.path.join(TMP, "daemon.log"), "a")
    d = subprocess.Popen([os.path.join(BUILD, "service", "moetraind"), "--listen", "127.0.0.1:0",
                          "--workdir", os.path.join(TMP, "wd"), "--token-file",
                          os.path.join(TMP, "token"), "--ready-file", ready, "--threads", "1"],
                         stderr=log, stdout=log)
    daemons.append(d)
    for _ in range(300):
        if os.path.exists(ready):
            break
        check(d.poll() is None, "moetraind exited at start")
        time.sleep(0.1)
    with open(ready) as f:
        addr = dict(line.strip().split("=", 1) for line in f if "=" in line)["grpc"]
    ch = grpc.insecure_channel(addr)
    grpc.channel_ready_future(ch).result(timeout=30)
    return d, ch


def stop_daemon(d):
    d.send_signal(signal.SIGTERM)
    check(d.wait(timeout=60) == 0, "moetraind exits 0 on SIGTERM")


def status(stub):
    return stub.GetStatus(pb.GetStatusRequest(), timeout=30)


def wait_step(stub, above, seconds=120):
    deadline = time.time() + seconds
    while status(stub).step <= above:
        check(time.time() < deadline, "the step passes %d" % above)
        time.sleep(0.2)


t0 = time.time()
d, ch = start_daemon()
stub = pb_grpc.TrainerStub(ch)
health = hpb_grpc.HealthStub(ch)
check(health.Check(hpb.HealthCheckRequest(service="")).status ==
      hpb.HealthCheckResponse.SERVING, "health SERVING")
check(health.Check(hpb.HealthCheckRequest(service="moetrain.v1.Trainer")).status ==
      hpb.HealthCheckResponse.SERVING, "Trainer SERVING")

# server reflection: services, then the descriptors that grpcurl would use
refl = rpb_grpc.ServerReflectionStub(ch)
reqs = [rpb.ServerReflectionRequest(list_services=""),
        rpb.ServerReflectionRequest(file_containing_symbol="moetrain.v1.Trainer")]
resps = list(refl.ServerReflectionInfo(iter(reqs), timeout=30))
names = {s.name for s in resps[0].list_services_response.service}
check({"moetrain.v1.Trainer", "grpc.health.v1.Health",
       "grpc.reflection.v1.ServerReflection"} <= names, "reflection lists the services")
pool = descriptor_pool.DescriptorPool()
for blob in resps[1].file_descriptor_response.file_descriptor_proto:
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(blob))
svc = pool.FindServiceByName("moetrain.v1.Trainer")
check(svc.FindMethodByName("StartJob").input_type.full_name == "moetrain.v1.StartJobRequest",
      "reflected StartJob takes a StartJobRequest")
check(pool.FindMessageTypeByName("moetrain.v1.JobSpec").fields_by_name["json"].number == 1,
      "reflected JobSpec.json")

# the token
try:
    stub.StartJob(pb.StartJobRequest(spec=pb.JobSpec(json=JOB, set=SETS)), timeout=30)
    check(False, "StartJob without a token must fail")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.UNAUTHENTICATED, "no token: UNAUTHENTICATED")

# an invalid spec names the field
try:
    stub.StartJob(pb.StartJobRequest(spec=pb.JobSpec(json=JOB, set=SETS + ["batch.seq_len=0"])),
                  metadata=AUTH, timeout=30)
    check(False, "an invalid spec must fail")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "batch.seq_len" in e.details(),
          "invalid spec: INVALID_ARGUMENT naming batch.seq_len (%s)" % e.details())

r = stub.StartJob(pb.StartJobRequest(spec=pb.JobSpec(json=JOB, set=SETS)), metadata=AUTH,
                  timeout=120)
check(r.job == "pyjob" and r.start_step == 0 and r.total_steps == 100000, "StartJob reply")

# the stream: consecutive steps of this run, no duplicates
stream = stub.StreamMetrics(pb.StreamMetricsRequest(from_step=1))
seen = []
for ev in stream:
    if ev.WhichOneof("event") == "step":
        seen.append(ev.step.step)
        check(ev.run_id == r.run_id, "events carry the run")
    if len(seen) == 5:
        break
stream.cancel()
check(seen == list(range(seen[0], seen[0] + 5)), "consecutive steps %s" % seen)

p = stub.PauseJob(pb.PauseJobRequest(), metadata=AUTH, timeout=60)
s = status(stub)
check(s.state == pb.JOB_STATE_PAUSED and s.step == p.step, "paused at the step the reply names")
time.sleep(1.5)
check(status(stub).step == p.step, "the step stays while paused")
try:
    stub.ResumeJob(pb.ResumeJobRequest(), timeout=30)
    check(False, "resume without a token must fail")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.UNAUTHENTICATED, "resume without token")
try:
    stub.PauseJob(pb.PauseJobRequest(), metadata=AUTH, timeout=30)
    check(False, "pausing twice must fail")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.FAILED_PRECONDITION, "pause twice: FAILED_PRECONDITION")
check(stub.ResumeJob(pb.ResumeJobRequest(), metadata=AUTH, timeout=60).step == p.step,
      "resumed at the paused step")
wait_step(stub, p.step)

saved = stub.SaveCheckpoint(pb.SaveCheckpointRequest(), metadata=AUTH, timeout=300).checkpoint
check(saved.name.startswith("step_") and saved.step > p.step, "SaveCheckpoint %s" % saved.name)
lst = stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=30)
check(saved.name in [c.name for c in lst.checkpoints], "ListCheckpoints has the save")
stop = stub.StopJob(pb.StopJobRequest(save=True), metadata=AUTH, timeout=300)
check(stop.checkpoint.step == stop.step and stop.step >= saved.step, "StopJob saved its step")
s = status(stub)
check(s.state == pb.JOB_STATE_IDLE and s.outcome == "stopped", "IDLE after the stop")
check(s.last_checkpoint.name == stop.checkpoint.name, "status shows the last checkpoint")
ch.close()
stop_daemon(d)

# a restarted daemon starts the job from its checkpoint
d, ch = start_daemon()
stub = pb_grpc.TrainerStub(ch)
lst = stub.ListCheckpoints(pb.ListCheckpointsRequest(job="pyjob"), timeout=30)
check(lst.checkpoints[-1].step == stop.step, "the new daemon lists the checkpoints")
r = stub.StartJob(pb.StartJobRequest(spec=pb.JobSpec(json=JOB, set=SETS),
                                     from_checkpoint="latest"), metadata=AUTH, timeout=120)
check(r.start_step == stop.step, "started from step %d" % r.start_step)
wait_step(stub, stop.step)
stub.StopJob(pb.StopJobRequest(), metadata=AUTH, timeout=120)
ch.close()
stop_daemon(d)
print("python grpcio client: %d checks in %.1f s" % (checks, time.time() - t0))
print("%d passed, 0 failed" % checks)
