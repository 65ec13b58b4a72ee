"""End-to-end throughput, invariant vs standard engine in one run (JSON lines).

Same as ``samebits bench``; see samebits/tools/bench.py for the options.
"""

from samebits.tools.bench import main

if __name__ == "__main__":
    main()
