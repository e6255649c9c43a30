from apirctl.cli import main

main()
