import subprocess
import sys

# Far more emits and void calls than True and None have references in a fresh process: without the
# guard (or a fixed PySide6) this child aborts with "bool_dealloc" or "none_dealloc".
CHILD = """
import sys
import stowage.app
from PySide6.QtCore import QCoreApplication, QObject, Signal

class Emitter(QObject):
    fired = Signal(int, str)

qt = QCoreApplication([])
emitter = Emitter()
received = []
emitter.fired.connect(lambda n, text: received.append(n))
count = 20_000  # a fresh process holds ~600 references to True
for n in range(count):
    emitter.fired.emit(n, "token")  # 6.12.0 drops a reference to True here
    emitter.setObjectName("e")  # and one to None in every void method
assert len(received) == count
print("ok", count)
"""


def test_many_signal_emits_do_not_crash_the_interpreter():
    result = subprocess.run([sys.executable, "-P", "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok")
