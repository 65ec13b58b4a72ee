"""End-to-end throughput, invariant vs standard engine in one run (JSON lines).

Same as ``samebits bench``; see samebits/bench.py for the options.
"""

from samebits.bench import main

if __name__ == "__main__":
    main()
