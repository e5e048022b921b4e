"""The local launcher's view of its role processes: when a run stalls, the driver asks every role for its threads'
stacks (SIGUSR1, which `pipelines.roles` hands to faulthandler) and names each role's last log line."""
import sys
import time

from pipelines.launch import LocalLauncher, _last_line

ROLE = ("import faulthandler, signal, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "print('waiting for weights of version 3', flush=True)\n"
        "time.sleep(60)\n")


def test_a_stalled_roles_stacks_land_in_its_log_and_its_last_words_are_named(tmp_path):
    script = tmp_path / "role.py"
    script.write_text(ROLE)
    launcher = LocalLauncher({"graph-server-0": [sys.executable, str(script)]}, tmp_path / "logs")
    launcher.start()
    log = tmp_path / "logs" / "graph-server-0.log"
    try:
        deadline = time.monotonic() + 30
        while _last_line(log) != "waiting for weights of version 3":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        launcher.dump_stacks(settle_s=0.5)
        text = log.read_text()
        assert "most recent call first" in text and "role.py" in text  # the sleeping main thread's frame
        assert _last_line(log, skip_stacks=True) == "waiting for weights of version 3"
        assert _last_line(log) != "waiting for weights of version 3"
        launcher.check()  # still running: no failure
    finally:
        launcher.terminate(grace_s=2)
