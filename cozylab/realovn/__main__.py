from cozylab.realovn.report import main

main()
