"""``python -m kvo_vllm.proxy``: same as the ``kvo-proxy`` console script."""

from kvo_vllm.proxy.cli import main

raise SystemExit(main())
