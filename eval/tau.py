"""Mean accepted length (tau) and speedup of a proposer against plain `generate` on one target.

    python eval/tau.py --target smollm2-135m-instruct --proposer prompt-lookup --bench mt_bench \
        --temperature 0 --tree chain:4 --limit 5 --max-new-tokens 128 --json out.json

`python eval/tau.py --help` lists the options; what is measured and how is documented in
drafters.decode.evaluate, which eval/compare.py runs in-process too.
"""

from drafters.decode.evaluate import main

if __name__ == "__main__":
    main()
