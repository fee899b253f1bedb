// `#[amp(...)]` on a generic parameter would do nothing; it is refused, pointing to the field.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block<#[amp(fp16)] A> {
    attn: A,
}

fn main() {}
