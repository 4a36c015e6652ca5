//! One module per subcommand.

pub mod up;
