from cozyebpf.cli import main

main()
