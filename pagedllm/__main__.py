from pagedllm.entrypoints.cli import main

main()
