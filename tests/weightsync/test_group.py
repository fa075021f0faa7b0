"""The weight group's ends: a group the trainer's watchdog aborted mid-sync is ended again by the failed sync's
cleanup and by the trainer's close, which must leave it be (destroying it raises: torch forgot it at the abort)."""

from services.weightsync.group import abort_group, destroy_group, end_group, init_custom_process_group


def test_a_group_aborted_by_the_watchdog_is_ended_again_without_an_error(free_port):
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{free_port()}", 1, 0, "aborted-by-the-watchdog")
    abort_group(group, linger_s=0)
    end_group(group, in_flight=False)  # the failed sync's cleanup
    destroy_group(group)  # the trainer's close


def test_a_group_with_nothing_in_flight_is_destroyed(free_port):
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{free_port()}", 1, 0, "ended-cleanly")
    end_group(group, in_flight=False)
    destroy_group(group)  # already gone: nothing to do
