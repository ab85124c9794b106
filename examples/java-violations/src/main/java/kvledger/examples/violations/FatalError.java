package kvledger.examples.violations;

/** An expected failure (bad option, missing schema, unreachable broker): reported as one line, exit 2. */
final class FatalError extends RuntimeException {
    private static final long serialVersionUID = 1L;

    FatalError(String message) {
        super(message, null, false, false);
    }

    /** What went wrong at the bottom of a chain of causes, for a one-line message. */
    static String rootCause(Throwable e) {
        Throwable root = e;
        while (root.getCause() != null && root.getCause() != root) {
            root = root.getCause();
        }
        String message = root.getMessage();
        return message == null || message.isBlank() ? root.getClass().getSimpleName() : message;
    }
}
