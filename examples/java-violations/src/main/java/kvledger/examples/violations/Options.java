package kvledger.examples.violations;

import java.net.URI;
import java.net.URISyntaxException;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;

/** The command line. */
record Options(
        String bootstrap,
        String topicPrefix,
        Path schemaDir,
        List<Path> writerSchemas,
        URI registry,
        Duration idleTimeout,
        String group) {

    static final String USAGE = String.join("\n",
            "usage: java -jar kvledger-violations.jar --bootstrap HOST:PORT [options]",
            "",
            "Print every violation of <prefix>.violations once (JSON lines, as `kvledger violations",
            "--format json`), then a summary line; exit when no record came for the idle timeout.",
            "",
            "  --bootstrap HOST:PORT   Kafka bootstrap server(s) (required)",
            "  --topic-prefix PREFIX   topic prefix (default kvledger)",
            "  --schemas DIR           the project's schemas/avro folder (default: found above the",
            "                          working directory or this jar)",
            "  --writer-schema FILE    an older violation.avsc whose records may still be on the topic",
            "                          (repeatable)",
            "  --registry URL          Schema Registry for records in the Confluent framing (00 + id)",
            "  --idle-timeout SECONDS  exit after this long without a new record (default 10)",
            "  --group ID              consumer group (default: a fresh one, so the whole topic is read)",
            "",
            "Exit status: 0 no violations, 1 violations found, 2 unusable input or unreachable broker.");

    /** The options, or null when help was asked for. */
    static Options parse(String[] args) {
        String bootstrap = null;
        String topicPrefix = "kvledger";
        Path schemaDir = null;
        List<Path> writerSchemas = new ArrayList<>();
        URI registry = null;
        Duration idleTimeout = Duration.ofSeconds(10);
        String group = "kvledger-violations-java-" + UUID.randomUUID();
        for (int i = 0; i < args.length; i++) {
            String option = args[i];
            if (option.equals("-h") || option.equals("--help")) {
                return null;
            }
            if (i + 1 >= args.length) {
                throw new FatalError(option.startsWith("--") ? option + " needs a value" : usageError(option));
            }
            String value = args[++i];
            switch (option) {
                case "--bootstrap" -> bootstrap = value;
                case "--topic-prefix" -> topicPrefix = value;
                case "--schemas" -> schemaDir = Path.of(value);
                case "--writer-schema" -> writerSchemas.add(Path.of(value));
                case "--registry" -> registry = registryUri(value);
                case "--idle-timeout" -> idleTimeout = seconds(value);
                case "--group" -> group = value;
                default -> throw new FatalError(usageError(option));
            }
        }
        if (bootstrap == null || bootstrap.isBlank()) {
            throw new FatalError("--bootstrap HOST:PORT is required (see --help)");
        }
        return new Options(bootstrap, topicPrefix, schemaDir, List.copyOf(writerSchemas), registry, idleTimeout, group);
    }

    private static String usageError(String option) {
        return "unknown option " + option + " (see --help)";
    }

    private static Duration seconds(String value) {
        double seconds;
        try {
            seconds = Double.parseDouble(value);
        } catch (NumberFormatException e) {
            throw new FatalError("--idle-timeout: not a number of seconds: " + value);
        }
        if (!(seconds >= 0.1)) {
            throw new FatalError("--idle-timeout must be at least 0.1 seconds, not " + value);
        }
        return Duration.ofMillis(Math.round(seconds * 1000));
    }

    private static URI registryUri(String value) {
        try {
            URI uri = new URI(value.replaceAll("/+$", ""));
            if (uri.getScheme() == null || !uri.getScheme().matches("https?") || uri.getHost() == null) {
                throw new URISyntaxException(value, "expected http(s)://HOST[:PORT][/path]");
            }
            return uri;
        } catch (URISyntaxException e) {
            throw new FatalError("--registry: " + e.getMessage());
        }
    }
}
