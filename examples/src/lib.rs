//! Small programs a user copies. [`router`] is the library half of `openai_router`.

pub mod router;
