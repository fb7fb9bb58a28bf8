"""In-process runners: Tandem's components wired into one process (``runners.serial``)."""
