"""A scenario whose asserts judge paces on loopback, run again once when it fails."""


def twice_on_a_loaded_machine(scenario, attempts: int = 2) -> None:
    """Runs `scenario` (its asserts judge paces on loopback), and again if it fails, `attempts` times
    in all: these two cores are shared with the suite's other lane, and at its busiest (a full suite
    run, both lanes training) a healthy peer's pace dropped far enough to look like a slow link. A
    fault in the code fails every run."""
    for attempt in range(1, attempts + 1):
        try:
            scenario()
            return
        except AssertionError as failed:
            if attempt == attempts:
                raise
            print(f"once more, after: {str(failed)[:300]}")
