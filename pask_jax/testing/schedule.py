"""A pytest-xdist ``--dist loadfile`` scheduler whose work units are groups of files, and that
survives a crashed worker (the suite's scheduler: tests/conftest.py).

pytest-xdist 3.8's scope schedulers deadlock after a worker crash (pytest-xdist issues #1323,
#1327, #1378): ``remove_node`` puts the dead worker's whole workload back on the queue, its
finished files included, which later go out as empty units that never report completion; the
test it died on is queued to run again (and crash the replacement too); and a worker that holds
only its last test waits for a next one that ``_reschedule`` never sends.  The run then hangs
with idle workers until CI's time limit instead of ending with the crash reported as a failure.
Here the dead worker's finished units are dropped, the test it died on is marked done
(``handle_crashitem`` has reported it failed), and a node is topped up until it holds more than
two pending tests or the queue is empty, and told to shut down once the queue is empty (a
replacement worker that has not finished collecting waits for its own collection's end, where
xdist schedules again).  A worker that dies while it is being topped up (its channel closed
before xdist has reported the crash) keeps the unit it was sent; the crash report puts it back.
"""
from __future__ import annotations

from typing import Callable


def grouped_files(config, log, unit: Callable[[str], str]):
  """The scheduler for ``pytest_xdist_make_scheduler``: ``unit(nodeid)`` names the work unit
  (a file, or a group of files one worker runs in turn)."""
  from xdist.scheduler import LoadFileScheduling

  class GroupedFiles(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return unit(nodeid)

    def remove_node(self, node):
      workload = self.assigned_work.pop(node)
      pending = [(scope, nodeid) for scope, tests in workload.items()
                 for nodeid, done in tests.items() if not done]
      if not pending:
        return None
      scope, crashitem = pending[0]
      workload[scope][crashitem] = True
      # before the queue's own units: the dead worker's files were started first
      left = {s: tests for s, tests in workload.items() if not all(tests.values())}
      rest = list(self.workqueue.items())
      self.workqueue.clear()
      self.workqueue.update(left)
      self.workqueue.update(rest)
      for other in self.assigned_work:
        self._reschedule(other)
      return crashitem

    def _reschedule(self, node):
      # a replacement worker still collecting gets its work at its own collection's end
      if node.shutting_down or node not in self.registered_collections:
        return
      while self.workqueue and self._pending_of(self.assigned_work.get(node, {})) <= 2:
        try:
          self._assign_work_unit(node)
        except OSError:
          # The worker died after its last message (a crash in a test it already holds, while
          # this loop tops it up: the initial schedule's second round).  The unit stays in its
          # workload, which remove_node puts back on the queue when the crash is reported.
          return
      if not self.workqueue:
        node.shutdown()

  return GroupedFiles(config, log)
